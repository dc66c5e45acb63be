"""Binary framing of the data plane: tags, request headers and replies.

No protobuf here: a request is one small struct-packed message, the block bytes travel as
separate tagged messages straight between the caller's buffers and the store's slots.

Tag layout (64 bits), one tag per message so replies of pipelined requests never mix:

| bits  | field   | meaning                                             |
|-------|---------|-----------------------------------------------------|
| 60-63 | kind    | REQUEST, REPLY, BLOCK, DONE                         |
| 40-59 | client  | connection id the server handed out over gRPC       |
| 16-39 | request | per-connection request counter (wraps)              |
| 0-15  | index   | block position in the request (BLOCK only)          |
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvstore import errors
from kvstore.keys import KEY_BYTES

MAX_CLIENTS = 1 << 20
MAX_REQUESTS = 1 << 24
MAX_BLOCKS = 1 << 16
_HEAD = struct.Struct("<BIQB")  # op, num_keys, block_bytes, has_parents
_REPLY = struct.Struct("<BQQ")  # is_error, reservation_id, block_bytes


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    BLOCK = 3
    DONE = 4


class Op(enum.IntEnum):
    GET = 1
    PUT = 2
    CLOSE = 3


def tag(kind: Kind, client_id: int, request_id: int = 0, index: int = 0) -> int:
    """The 64-bit tag of one message (see the module table)."""
    assert 0 <= client_id < MAX_CLIENTS, "client id out of range"
    assert 0 <= index < MAX_BLOCKS, "block index out of range"
    return (kind << 60) | (client_id << 40) | ((request_id % MAX_REQUESTS) << 16) | index


class Request(NamedTuple):
    """What a client asks: GET keys into buffers of `block_bytes`, or PUT blocks."""

    op: Op
    request_id: int
    namespace_id: bytes
    keys: tuple[bytes, ...]
    block_bytes: int
    parents: tuple[bytes | None, ...] | None = None
    checksums: tuple[int, ...] = ()


def request_bytes(max_keys: int) -> int:
    """Largest encoded request for `max_keys` keys: the server's receive buffer size."""
    return _HEAD.size + 8 + KEY_BYTES + max_keys * (2 * KEY_BYTES + 4)


def encode_request(req: Request) -> bytes:
    keys = req.keys
    parts = [
        _HEAD.pack(req.op, len(keys), req.block_bytes, req.parents is not None),
        struct.pack("<Q", req.request_id),
        req.namespace_id.ljust(KEY_BYTES, b"\0")[:KEY_BYTES],
        b"".join(keys),
    ]
    if req.parents is not None:
        parts.append(b"".join(p or bytes(KEY_BYTES) for p in req.parents))
    if req.op is Op.PUT:
        parts.append(struct.pack(f"<{len(keys)}I", *req.checksums))
    return b"".join(parts)


def decode_request(data: memoryview) -> Request:
    """Raises InvalidArgumentError for a truncated or malformed request."""
    try:
        op, num_keys, block_bytes, has_parents = _HEAD.unpack_from(data)
        (request_id,) = struct.unpack_from("<Q", data, _HEAD.size)
        pos = _HEAD.size + 8
        namespace_id = bytes(data[pos : pos + KEY_BYTES])
        pos += KEY_BYTES
        keys, pos = _keys_at(data, pos, num_keys)
        parents = None
        if has_parents:
            raw, pos = _keys_at(data, pos, num_keys)
            parents = tuple(None if p == bytes(KEY_BYTES) else p for p in raw)
        checksums: tuple[int, ...] = ()
        if op == Op.PUT:
            checksums = struct.unpack_from(f"<{num_keys}I", data, pos)
        return Request(Op(op), request_id, namespace_id, keys, block_bytes, parents, checksums)
    except (struct.error, ValueError) as exc:
        raise errors.InvalidArgumentError(f"malformed data-plane request: {exc}") from None


def _keys_at(data: memoryview, pos: int, num: int) -> tuple[tuple[bytes, ...], int]:
    end = pos + num * KEY_BYTES
    if end > len(data):
        raise ValueError("keys run past the end of the message")
    raw = bytes(data[pos:end])
    return tuple(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)), end


class Reply(NamedTuple):
    """The server's answer to a request: per-block flags, or a typed error."""

    flags: tuple[int, ...] = ()  # GET: 1 found / 0 missed; PUT: PutStatus values
    reservation_id: int = 0
    block_bytes: int = 0
    error: errors.KVStoreError | None = None


def reply_bytes(num_keys: int) -> int:
    """Receive buffer for a reply to `num_keys` keys (room for an error message)."""
    return _REPLY.size + max(num_keys, 1) + 1024


def encode_reply(reply: Reply) -> bytes:
    if reply.error is not None:
        text = f"{type(reply.error).__name__}\n{reply.error.code}\n{reply.error}"
        return _REPLY.pack(1, 0, 0) + text.encode()[:1000]
    return _REPLY.pack(0, reply.reservation_id, reply.block_bytes) + bytes(reply.flags)


def decode_reply(data: memoryview, num_keys: int) -> Reply:
    is_error, reservation_id, block_bytes = _REPLY.unpack_from(data)
    body = bytes(data[_REPLY.size :])
    if is_error:
        name, code, message = body.rstrip(b"\0").decode(errors="replace").split("\n", 2)
        return Reply(error=errors.error_class(name, code)(message))
    return Reply(tuple(body[:num_keys]), reservation_id, block_bytes)


def check_num_blocks(num: int, label: str = "blocks") -> None:
    if num >= MAX_BLOCKS:
        raise errors.BatchTooLargeError(
            f"{num} {label} in one data-plane call (max {MAX_BLOCKS - 1})"
        )


def flags_of(values: Sequence[bool | int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)
