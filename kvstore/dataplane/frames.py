"""Binary framing of the data plane: tags, request frames and replies.

No protobuf here: a request is one small struct-packed frame, the block bytes travel as
separate tagged messages straight between the caller's buffers and the store's slots.

UCX matches tagged messages worker-wide, whoever sent them, so a tag is the only thing that
binds a message to its connection. Tags are therefore derived from the connection's secret
(16 random bytes handed out by the gRPC handshake, never sent over UCX):

| bits  | field   | meaning                                                            |
|-------|---------|--------------------------------------------------------------------|
| 60-63 | kind    | REQUEST, REPLY, BLOCK, DONE                                        |
| 16-59 | request | keyed BLAKE2b of the request id under the secret (44 bits)         |
| 0-15  | index   | block position in the request (BLOCK only)                         |

A GET may ask for its blocks in `segments` equal parts, sent part-major (part 0 of every
found block, then part 1, ...) under index `part * num_keys + key`: a reader whose block is
one layer after another gets every block's first layer before any block's second, and can
receive each part straight into the memory where that layer lives.

A peer without the secret cannot send a frame any receive of this connection matches, nor
receive one meant for it. Request ids only have to be unique among a connection's calls in
flight; they are never identity.

Frames are checked exactly: a frame states its length and ends with the CRC32C of what
precedes it, the body must be exactly as long as its header implies, and the zeroed receive
buffer must hold nothing past the frame. UCX does not say how many bytes a receive got, so
this is what tells a short frame from a zero-padded one, or a long one from a full buffer.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KEY_BYTES
from kvstore.results import PutStatus

SECRET_BYTES = 16
MAX_BLOCKS = 1 << 16
_LEN = struct.Struct("<I")  # frame length, trailer included
_CRC = struct.Struct("<I")
_HEAD = struct.Struct("<BIQBQ")  # op, num_keys, block_bytes, flags, request_id
_HAS_PARENTS, _EAGER, _SEGMENTED = 1, 2, 4  # request flags
_SEGMENTS = struct.Struct("<H")  # a segmented GET's number of parts, after its keys
SEGMENTS_BYTES = _SEGMENTS.size
_REPLY = struct.Struct("<BQQI")  # is_error, reservation_id, block_bytes, num_flags
_REQUEST_BITS = 44
MAX_REQUEST_ID = (1 << 64) - 1  # a frame's request id is a u64
BASE_MASK = ((1 << _REQUEST_BITS) - 1) << 16  # the request bits of a tag (module table)
_MAX_ERROR_TEXT = 1000
# A PUT reply's flags: the index of each block's status here, on every plane.
STATUS_CODES = (PutStatus.RESERVED, PutStatus.PRESENT, PutStatus.IN_FLIGHT)


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    BLOCK = 3
    DONE = 4


class Op(enum.IntEnum):
    GET = 1
    PUT = 2
    CLOSE = 3
    PING = 4  # no reply: says the client holds the secret and is alive


_OPS = frozenset(op.value for op in Op)


class Tags:
    """The tags of one connection, derived from its secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise errors.InvalidArgumentError(f"connection secret must be {SECRET_BYTES} bytes")
        self.secret = secret
        self.request = self.tag(Kind.REQUEST, 0)  # every request frame of the connection

    def base(self, request_id: int) -> int:
        digest = hashlib.blake2b(
            request_id.to_bytes(8, "little"), key=self.secret, digest_size=8
        ).digest()
        return (int.from_bytes(digest, "little") & ((1 << _REQUEST_BITS) - 1)) << 16

    def tag(self, kind: Kind, request_id: int, index: int = 0) -> int:
        """The tag of one message of request `request_id` (see the module table)."""
        assert 0 <= index < MAX_BLOCKS, "block index out of range"
        return (kind << 60) | self.base(request_id) | index


class RequestTags(NamedTuple):
    """A request's tags, derived once: `block(i)` is a bit-or, not a hash."""

    reply: int
    done: int
    block_base: int

    @classmethod
    def of(cls, tags: Tags, request_id: int) -> RequestTags:
        base = tags.base(request_id)
        return cls((Kind.REPLY << 60) | base, (Kind.DONE << 60) | base, (Kind.BLOCK << 60) | base)

    def block(self, index: int) -> int:
        assert 0 <= index < MAX_BLOCKS, "block index out of range"
        return self.block_base | index


class Request(NamedTuple):
    """What a client asks: GET keys into buffers of `block_bytes`, or PUT blocks.

    `eager` (PUT only): the client sends block i of every key right behind the request,
    without waiting for the reply, so the bytes move while the node reserves; the node
    receives the blocks of keys it did not reserve (present, in flight, or all of them after
    an error) into scratch memory and drops them. Else only the reserved blocks follow,
    once the client has the reply.

    `segments` (GET only): the blocks come in that many equal parts, part-major (module
    docstring); 1 is a whole block per message.
    """

    op: Op
    request_id: int
    namespace_id: bytes
    keys: tuple[bytes, ...]
    block_bytes: int
    parents: tuple[bytes | None, ...] | None = None
    checksums: tuple[int, ...] = ()
    eager: bool = False
    segments: int = 1


def seal(body: bytes) -> bytes:
    """`body` framed: its length in front, the CRC32C of both behind."""
    head = _LEN.pack(_LEN.size + len(body) + _CRC.size) + body
    return head + _CRC.pack(checksum(head))


def unseal(data: memoryview, what: str) -> memoryview:
    """The body of a sealed frame received into `data` (which may be longer)."""
    if len(data) < _LEN.size + _CRC.size:
        raise errors.InvalidArgumentError(f"{what} frame of {len(data)} bytes is too short")
    (length,) = _LEN.unpack_from(data)
    if not _LEN.size + _CRC.size <= length <= len(data):
        raise errors.InvalidArgumentError(
            f"{what} frame says {length} bytes; 8 to {len(data)} fit its buffer"
        )
    (crc,) = _CRC.unpack_from(data, length - _CRC.size)
    if checksum(data[: length - _CRC.size]) != crc:
        raise errors.InvalidArgumentError(f"{what} frame is damaged or short (bad checksum)")
    if np.frombuffer(data[length:], np.uint8).any():  # the buffer was zeroed: bytes past it
        raise errors.InvalidArgumentError(f"{what} frame is longer than the {length} it says")
    return data[_LEN.size : length - _CRC.size]


def request_bytes(max_keys: int) -> int:
    """Largest encoded request for `max_keys` keys: the server's receive buffer size."""
    return _LEN.size + _HEAD.size + KEY_BYTES + max_keys * (2 * KEY_BYTES + 4) + _CRC.size


def _body_bytes(op: int, num_keys: int, has_parents: bool, segmented: bool) -> int:
    per_key = KEY_BYTES * (2 if has_parents else 1) + (4 if op == Op.PUT else 0)
    return _HEAD.size + KEY_BYTES + num_keys * per_key + (_SEGMENTS.size if segmented else 0)


def check_segments(num_keys: int, block_bytes: int, segments: int) -> None:
    """Raises InvalidArgumentError unless `segments` equal parts of every block can each be
    told apart by its tag."""
    if segments < 1 or block_bytes % segments or num_keys * segments > MAX_BLOCKS:
        raise errors.InvalidArgumentError(
            f"{segments} segments of {block_bytes}-byte blocks for {num_keys} keys: "
            f"they must divide the block and keys x segments must be <= {MAX_BLOCKS}"
        )


def encode_request(req: Request) -> bytes:
    keys = req.keys
    flags = (_HAS_PARENTS if req.parents is not None else 0) | (_EAGER if req.eager else 0)
    flags |= _SEGMENTED if req.segments != 1 else 0
    parts = [
        _HEAD.pack(req.op, len(keys), req.block_bytes, flags, req.request_id),
        req.namespace_id.ljust(KEY_BYTES, b"\0")[:KEY_BYTES],
        b"".join(keys),
    ]
    if req.parents is not None:
        parts.append(b"".join(p or bytes(KEY_BYTES) for p in req.parents))
    if req.op is Op.PUT:
        parts.append(struct.pack(f"<{len(keys)}I", *req.checksums))
    if req.segments != 1:
        parts.append(_SEGMENTS.pack(req.segments))
    return seal(b"".join(parts))


def decode_request(data: memoryview) -> Request:
    """Raises InvalidArgumentError for a short, long, damaged or malformed request."""
    body = unseal(data, "request")
    if len(body) < _HEAD.size + KEY_BYTES:
        raise errors.InvalidArgumentError(f"request body of {len(body)} bytes is too short")
    op, num_keys, block_bytes, flags, request_id = _HEAD.unpack_from(body)
    eager, segmented = bool(flags & _EAGER), bool(flags & _SEGMENTED)
    if (
        op not in _OPS
        or flags & ~(_HAS_PARENTS | _EAGER | _SEGMENTED)
        or (eager and op != Op.PUT)
        or (segmented and op != Op.GET)
    ):
        raise errors.InvalidArgumentError(f"request has unknown op {op} or flags {flags}")
    has_parents = flags & _HAS_PARENTS
    expected = _body_bytes(op, num_keys, bool(has_parents), segmented)
    if len(body) != expected:
        raise errors.InvalidArgumentError(
            f"request of {num_keys} keys needs {expected} bytes, got {len(body)}"
        )
    pos = _HEAD.size
    namespace_id = bytes(body[pos : pos + KEY_BYTES])
    keys, pos = _keys_at(body, pos + KEY_BYTES, num_keys)
    parents = None
    if has_parents:
        raw, pos = _keys_at(body, pos, num_keys)
        parents = tuple(None if p == bytes(KEY_BYTES) else p for p in raw)
    checksums: tuple[int, ...] = ()
    if op == Op.PUT:
        checksums = struct.unpack_from(f"<{num_keys}I", body, pos)
    segments = 1
    if segmented:
        (segments,) = _SEGMENTS.unpack_from(body, pos)
        if segments < 2:  # one part is an unsegmented GET: said one way only
            raise errors.InvalidArgumentError(f"a segmented GET of {segments} segments")
        check_segments(num_keys, block_bytes, segments)
    return Request(
        Op(op), request_id, namespace_id, keys, block_bytes, parents, checksums, eager, segments
    )


def _keys_at(data: memoryview, pos: int, num: int) -> tuple[tuple[bytes, ...], int]:
    end = pos + num * KEY_BYTES
    raw = bytes(data[pos:end])
    return tuple(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)), end


class Reply(NamedTuple):
    """The server's answer to a request: per-block flags, or a typed error.

    A GET reply also carries the CRC32C of every block it sends (`checksums`, in key order
    over the found keys), which the client checks each block against as it lands.
    """

    flags: tuple[int, ...] = ()  # GET: 1 found / 0 missed; PUT: PutStatus values
    reservation_id: int = 0
    block_bytes: int = 0
    error: errors.KVStoreError | None = None
    checksums: tuple[int, ...] = ()


def reply_bytes(num_keys: int) -> int:
    """Receive buffer for a reply to `num_keys` keys (room for an error message)."""
    body = _REPLY.size + max(num_keys * 5, _MAX_ERROR_TEXT + 64)
    return _LEN.size + body + _CRC.size


def encode_reply(reply: Reply) -> bytes:
    if reply.error is not None:
        text = f"{type(reply.error).__name__}\n{reply.error.code}\n{reply.error}"
        raw = text.encode()[:_MAX_ERROR_TEXT]
        return seal(_REPLY.pack(1, 0, 0, len(raw)) + raw)
    head = _REPLY.pack(0, reply.reservation_id, reply.block_bytes, len(reply.flags))
    sums = struct.pack(f"<{len(reply.checksums)}I", *reply.checksums)
    return seal(head + bytes(reply.flags) + sums)


def decode_reply(data: memoryview, num_keys: int, with_checksums: bool = False) -> Reply:
    """Raises InvalidArgumentError unless the reply is exactly one for `num_keys` keys."""
    body = unseal(data, "reply")
    if len(body) < _REPLY.size:
        raise errors.InvalidArgumentError(f"reply body of {len(body)} bytes is too short")
    is_error, reservation_id, block_bytes, num = _REPLY.unpack_from(body)
    rest = bytes(body[_REPLY.size :])
    if is_error:
        parts = rest[:num].decode(errors="replace").split("\n", 2)
        if len(parts) != 3 or len(rest) != num:
            raise errors.InvalidArgumentError("error reply is malformed")
        return Reply(error=errors.error_class(parts[0], parts[1])(parts[2]))
    flags = tuple(rest[:num])
    num_sums = sum(f != 0 for f in flags) if with_checksums else 0
    if num != num_keys or len(rest) != num + 4 * num_sums:
        raise errors.InvalidArgumentError(f"reply does not answer a request of {num_keys} keys")
    checksums = struct.unpack_from(f"<{num_sums}I", rest, num)
    return Reply(flags, reservation_id, block_bytes, None, checksums)


def check_num_blocks(num: int, label: str = "blocks") -> None:
    if num >= MAX_BLOCKS:
        raise errors.BatchTooLargeError(
            f"{num} {label} in one data-plane call (max {MAX_BLOCKS - 1})"
        )


def flags_of(values: Sequence[bool | int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)
