"""Messages of the socket data planes: the same-host plane over its Unix stream socket,
and the TCP plane (`tcp.server`, `tcp.client`), whose CALLs carry no placement frame
(`decode_call(placed=False)`) and no file descriptors, with each call's block bytes on the
stream between its messages.

Every message is its length (u32) and then that many bytes; a length past what the reader
takes ends the connection before anything is read into memory. File descriptors travel
beside a message's bytes (SCM_RIGHTS); a reader closes every one it did not ask for. Calls
reuse the frames of the UCX data plane (`frames`): the same requests, replies, checksums
and limits, each checked exactly.

| message | from   | bytes                                          | fds                     |
|---------|--------|------------------------------------------------|-------------------------|
| HELLO   | client | kind, connection id (u32), secret (16 bytes)   | its region              |
| REGION  | client | kind, region index (u8)                        | a region at that index  |
| CALL    | client | kind, a request frame, a placement frame       | none                    |
| SUMS    | client | kind, a sealed request id (u64), CRC32C each   | none                    |
| REPLY   | node   | kind, a reply frame                            | none                    |
| LANDED  | node   | kind, request id (u64), first unit (u32), flags | none                   |

The node answers HELLO and REGION (a reply whose `block_bytes` is its region limit, or an
error) and every CALL but PING and CLOSE, in order. While it copies a GET's blocks, it says
which have landed (LANDED: units from the first named on are done, a found flag each, 0 or
1), after every `NOTE_BYTES` or more it copied, so the client checks them while later ones
are still being copied, and, in a call it noted before, after the last block too (the
client checks the last ones while the node replies); the REPLY follows. A unit is part s
of key i, unit `s * num_keys + i` (a whole block, for a call of one part): a GET in parts
is copied part-major, and noted also at the end of each part of `NOTE_BYTES` or more, so
the client knows part s (a KV block's layer s) of every block is in while later parts are
still being copied. Notes are advice: a node whose socket would make it wait (a client not
reading) sends no more for that call, and the client takes at the reply what no note
named. HELLO's region is index 0 (the client's
staging); REGION puts one at its index, replacing any there. A placement frame holds where
every block a call moves is (u64 each, `regions.placement`: region index and offset): for
a PUT, block i; for a GET, where part s of block i goes, at `s * num_keys + i` (one part:
the whole block).

An eager PUT (`Request.eager`) is sent before its blocks are summed: its checksums come in
the SUMS message right behind it, so the client sums while the node copies. The node reads
that SUMS before it answers the PUT, whatever the answer.
"""

from __future__ import annotations

import array
import enum
import os
import socket
import struct
from collections.abc import Callable, Sequence

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Op, Request

_HELLO = struct.Struct(f"<BI{frames.SECRET_BYTES}s")
_LEN = struct.Struct("<I")  # a frame's first field, and a message's: its length
MAX_FDS = 1  # the most file descriptors one message may carry


class Kind(enum.IntEnum):
    HELLO = 1
    REGION = 2
    CALL = 3
    SUMS = 4
    REPLY = 5
    LANDED = 6


_SUMS_HEAD = struct.Struct("<Q")  # the request id the sums are for
_LANDED = struct.Struct("<BQI")  # kind, request id, first unit
NOTE_BYTES = 1 << 20  # a LANDED note costs a few microseconds: under 1/20 of copying this


def encode_hello(client_id: int, secret: bytes) -> bytes:
    return _HELLO.pack(Kind.HELLO, client_id, secret)


def decode_hello(data: memoryview) -> tuple[int, bytes]:
    """(connection id, secret); InvalidArgumentError unless `data` is exactly a HELLO."""
    if len(data) != _HELLO.size or data[0] != Kind.HELLO:
        raise errors.InvalidArgumentError(f"a {len(data)}-byte message is not a hello")
    _, client_id, secret = _HELLO.unpack(data)
    return client_id, secret


def num_placements(req: Request) -> int:
    """How many blocks (or parts) a call moves through the region."""
    if req.op is Op.GET:
        return req.segments * len(req.keys)
    return len(req.keys) if req.op is Op.PUT else 0


def encode_call(req: Request, offsets: Sequence[int], placed: bool = True) -> bytes:
    """A CALL; `placed`: with its placement frame (the shm plane's; the tcp plane moves
    blocks on the socket, in the order of the call, and places nothing)."""
    if not placed:
        return bytes([Kind.CALL]) + frames.encode_request(req)
    assert len(offsets) == num_placements(req), "one offset per block moved"
    placements = frames.seal(struct.pack(f"<{len(offsets)}Q", *offsets))
    return bytes([Kind.CALL]) + frames.encode_request(req) + placements


def decode_call(data: memoryview, placed: bool = True) -> tuple[Request, tuple[int, ...]]:
    """The request and its offsets (none unless `placed`); InvalidArgumentError for
    anything but exactly one well-formed CALL."""
    if len(data) < 1 + _LEN.size or data[0] != Kind.CALL:
        raise errors.InvalidArgumentError(f"a {len(data)}-byte message is not a call")
    (length,) = _LEN.unpack_from(data, 1)
    if length > len(data) - 1 or (not placed and length != len(data) - 1):
        raise errors.InvalidArgumentError(f"call says its request has {length} bytes")
    req = frames.decode_request(data[1 : 1 + length])
    if not placed:
        return req, ()
    body = frames.unseal(data[1 + length :], "placement")
    expected = num_placements(req)
    if len(body) != 8 * expected:
        raise errors.InvalidArgumentError(
            f"call moves {expected} blocks but places {len(body) / 8:g}"
        )
    return req, struct.unpack(f"<{expected}Q", body)


def encode_sums(request_id: int, sums: Sequence[int]) -> bytes:
    body = _SUMS_HEAD.pack(request_id) + struct.pack(f"<{len(sums)}I", *sums)
    return bytes([Kind.SUMS]) + frames.seal(body)


def decode_sums(data: memoryview, req: Request) -> tuple[int, ...]:
    """The checksums of eager PUT `req`; InvalidArgumentError unless `data` is exactly its
    SUMS message."""
    if len(data) < 1 or data[0] != Kind.SUMS:
        raise errors.InvalidArgumentError("an eager put must be followed by its sums")
    body = frames.unseal(data[1:], "sums")
    if len(body) != _SUMS_HEAD.size + 4 * len(req.keys):
        raise errors.InvalidArgumentError(f"sums for {len(req.keys)} keys take {len(body)} bytes")
    (request_id,) = _SUMS_HEAD.unpack_from(body)
    if request_id != req.request_id:
        raise errors.InvalidArgumentError(f"sums of request {request_id}, not {req.request_id}")
    return struct.unpack_from(f"<{len(req.keys)}I", body, _SUMS_HEAD.size)


def encode_reply(reply: frames.Reply) -> bytes:
    return bytes([Kind.REPLY]) + frames.encode_reply(reply)


def encode_landed(request_id: int, first: int, flags: Sequence[int]) -> bytes:
    return _LANDED.pack(Kind.LANDED, request_id, first) + bytes(flags)


def decode_landed(data: memoryview) -> tuple[int, int, bytes]:
    """(request id, first unit, found flags) of a LANDED note; ValueError if malformed."""
    if len(data) <= _LANDED.size or data[0] != Kind.LANDED:
        raise ValueError(f"a {len(data)}-byte message is not a landed note")
    _, request_id, first = _LANDED.unpack_from(data)
    flags = bytes(data[_LANDED.size :])
    if flags.strip(b"\0\1"):
        raise ValueError("a landed note's flags are 0 or 1")
    return request_id, first, flags


def receive_reply(
    sock: socket.socket,
    num_keys: int,
    get: bool,
    on_note: Callable[[int, int, bytes], None] | None,
) -> frames.Reply:
    """The next REPLY (to a call of `num_keys` keys, a GET's if `get`); a GET's LANDED
    notes before it go to `on_note` (none: dropped). Anything else the node sends breaks
    the stream (ConnectionError), as a malformed reply or note does, or a message longer
    than any of these can be (the rest of it would be read as the next one)."""
    max_bytes = frames.reply_bytes(num_keys) + 1
    if get:  # a note says one flag per unit: with copies landing out of order, up to all
        max_bytes = max(max_bytes, _LANDED.size + frames.MAX_BLOCKS)
    while True:
        try:
            data, fds = receive(sock, max_bytes)
        except errors.InvalidArgumentError as exc:
            raise ConnectionError(f"the node's stream is out of step: {exc}") from exc
        close_all(fds)
        kind = data[0] if data else None
        if kind == Kind.LANDED and get:
            try:
                note = decode_landed(data)
            except ValueError as exc:
                raise ConnectionError(f"malformed note: {exc}") from exc
            if on_note is not None:
                on_note(*note)
            continue
        if kind != Kind.REPLY:
            raise ConnectionError(f"the node sent a message of kind {kind}, not a reply")
        try:
            return frames.decode_reply(data[1:], num_keys, get)
        except errors.InvalidArgumentError as exc:  # the node's stream is broken, not ours
            raise ConnectionError(f"malformed reply: {exc}") from exc


def max_message_bytes(max_keys: int) -> int:
    """The largest message a node takes with batches of `max_keys` keys."""
    placements = 8 * frames.MAX_BLOCKS + 2 * _LEN.size
    return 1 + frames.request_bytes(max_keys) + frames.SEGMENTS_BYTES + placements


def connect(name: bytes, timeout_s: float) -> socket.socket:
    """A stream socket connected to the node's (abstract) socket `name`, with a timeout."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(name)
    except BaseException:
        sock.close()
        raise
    return sock


def framed(data: bytes) -> bytes:
    """One message as it goes on the stream: its length, then `data`."""
    return _LEN.pack(len(data)) + data


def send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Sends one message (and `fds` beside it)."""
    message = framed(data)
    if fds:
        sent = socket.send_fds(sock, [message], list(fds))
        message = message[sent:]
    if message:
        sock.sendall(message)


def try_send(sock: socket.socket, data: bytes) -> bool:
    """Sends one message if the socket takes it now; False, with nothing sent, if it would
    wait. A message the socket takes in part is finished as `send` would (rare: the
    socket's buffer ran out in the middle)."""
    message = _LEN.pack(len(data)) + data
    try:
        sent = sock.send(message, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    if sent < len(message):
        sock.sendall(message[sent:])
    return True


def receive(sock: socket.socket, max_bytes: int) -> tuple[memoryview, list[int]]:
    """One message and the file descriptors that came with it (the caller closes them).

    Raises ConnectionError when the peer has gone, InvalidArgumentError for a message over
    `max_bytes` (the stream is then out of step: the caller ends the connection).
    """
    fds: list[int] = []
    try:
        head = _receive_exactly(sock, bytearray(_LEN.size), fds)
        (length,) = _LEN.unpack(head)
        if length > max_bytes:
            raise errors.InvalidArgumentError(f"a message of {length} bytes; at most {max_bytes}")
        return memoryview(_receive_exactly(sock, bytearray(length), fds)), fds
    except BaseException:
        close_all(fds)
        raise


def _receive_exactly(sock: socket.socket, buf: bytearray, fds: list[int]) -> bytearray:
    view, got = memoryview(buf), 0
    room = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while got < len(buf):
        nbytes, ancillary, _, _ = sock.recvmsg_into([view[got:]], room)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if nbytes == 0:
            raise ConnectionError("the peer closed the connection")
        got += nbytes
    return buf


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
