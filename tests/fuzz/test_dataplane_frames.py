"""The data plane's frames under arbitrary input (hypothesis): pure properties of
`kvstore.dataplane.frames`. Every valid request and reply decodes to itself; every
truncation, extension with nonzero bytes and single bit flip of an encoded frame raises
InvalidArgumentError (exhaustively, every single bit flip of one request of each op); any
sealed body decodes to nothing but a request that encodes back to the same frame; and
arbitrary bytes raise nothing but InvalidArgumentError.
"""

from __future__ import annotations

import struct

from hypothesis import event, given
from hypothesis import strategies as st

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Op, Reply, Request
from tests.fuzz.dataplane_cases import (
    KNOWN_KEYS,
    NS,
    PROPERTIES,
    SERVER_BUF,
    _decode,
    keys32,
    nonzero,
    parent_keys,
    u32,
    u64,
)

# -- pure properties of frames -----------------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn, max_keys: int = 40) -> Request:
    """Any request the encoding can carry exactly."""
    op = draw(st.sampled_from(Op))
    keys = draw(st.lists(keys32, max_size=max_keys))
    parents = draw(
        st.none() | st.lists(st.none() | parent_keys, min_size=len(keys), max_size=len(keys))
    )
    checksums = draw(st.lists(u32, min_size=len(keys), max_size=len(keys))) if op is Op.PUT else []
    # A GET in parts: as many as divide the block, each part's tag within range.
    segments = draw(st.integers(2, 64)) if op is Op.GET and draw(st.booleans()) else 1
    return Request(
        op,
        draw(u64),
        draw(keys32),
        tuple(keys),
        draw(st.integers(0, (2**64 - 1) // segments)) * segments,
        None if parents is None else tuple(parents),
        tuple(checksums),
        draw(st.booleans()) if op is Op.PUT else False,  # eager: PUT only
        segments,
    )


@st.composite
def replies(draw: st.DrawFn) -> tuple[Reply, int, bool]:
    """A reply, the number of keys it answers, and whether it carries checksums."""
    if draw(st.booleans()):
        cls = draw(
            st.sampled_from([errors.BadKeyError, errors.StoreFullError, errors.KVStoreError])
        )
        return Reply(error=cls(draw(st.text(max_size=200)))), 0, False
    flags = draw(st.lists(st.integers(0, 255), max_size=64))
    with_checksums = draw(st.booleans())
    num_sums = sum(f != 0 for f in flags) if with_checksums else 0
    sums = draw(st.lists(u32, min_size=num_sums, max_size=num_sums))
    reply = Reply(tuple(flags), draw(u64), draw(u64), None, tuple(sums))
    return reply, len(flags), with_checksums


def _refused(data: bytes) -> bool:
    try:
        _decode(data)
    except errors.InvalidArgumentError:
        return True
    return False


@PROPERTIES
@given(req=requests(), room=st.integers(0, 64))
def test_every_request_decodes_to_itself(req, room):
    assert _decode(frames.encode_request(req), room) == req


@PROPERTIES
@given(reply=replies(), room=st.integers(0, 64))
def test_every_reply_decodes_to_itself(reply, room):
    reply, num_keys, with_checksums = reply
    data = memoryview(bytearray(frames.encode_reply(reply)) + bytes(room))
    got = frames.decode_reply(data, num_keys, with_checksums)
    if reply.error is None:
        assert got == reply
    else:
        assert type(got.error) is type(reply.error) and str(got.error) == str(reply.error)


@PROPERTIES
@given(req=requests(), data=st.data())
def test_damaged_request_frames_are_refused(req, data):
    """Cut anywhere (into a buffer that size, or a zeroed one the frame's size), extended
    with bytes not all zero, or with any one bit flipped: InvalidArgumentError."""
    frame = frames.encode_request(req)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    assert _refused(frame[:cut])
    padded = frame[:cut] + bytes(len(frame) - cut)
    assert _refused(padded) or padded == frame  # only when the bytes cut were zeros
    tail = data.draw(nonzero, label="tail")
    assert _refused(frame + tail)
    bit = data.draw(st.integers(0, 8 * len(frame) - 1), label="bit")
    flipped = bytearray(frame)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert _refused(bytes(flipped))


def test_every_single_bit_flip_of_a_frame_is_refused():
    """Exhaustively, for one request of each op and a GET in parts: CRC32C catches every
    single-bit error."""
    keys = KNOWN_KEYS[:2]
    reqs = [
        Request(op, 7, NS.id, keys, 4096, (None, keys[0]), (1, 2) if op is Op.PUT else ())
        for op in Op
    ]
    reqs.append(Request(Op.GET, 7, NS.id, keys, 4096, None, (), False, 8))
    for req in reqs:
        frame = frames.encode_request(req)
        for bit in range(8 * len(frame)):
            flipped = bytearray(frame)
            flipped[bit // 8] ^= 1 << (bit % 8)
            assert _refused(bytes(flipped)), f"{req.op.name}: bit {bit}"


@PROPERTIES
@given(reply=replies(), data=st.data())
def test_damaged_reply_frames_are_refused(reply, data):
    reply, num_keys, with_checksums = reply
    frame = frames.encode_reply(reply)

    def refused(raw: bytes) -> bool:
        try:
            frames.decode_reply(memoryview(bytearray(raw)), num_keys, with_checksums)
        except errors.InvalidArgumentError:
            return True
        return False

    assert refused(frame[: data.draw(st.integers(0, len(frame) - 1), label="cut")])
    assert refused(frame + data.draw(nonzero))
    bit = data.draw(st.integers(0, 8 * len(frame) - 1), label="bit")
    flipped = bytearray(frame)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert refused(bytes(flipped))


@st.composite
def sealed_bodies(draw: st.DrawFn) -> bytes:
    """Bodies with a valid length and checksum: random, or a real request's body with one
    header field changed, or cut and extended."""
    mode = draw(st.sampled_from(["field", "field", "resize", "random"]))
    if mode == "random":
        return draw(st.binary(max_size=400))
    body = bytearray(frames.encode_request(draw(requests(max_keys=6)))[4:-4])
    if mode == "resize":
        return bytes(body[: draw(st.integers(0, len(body)))]) + draw(st.binary(max_size=70))
    field_at = draw(st.sampled_from([0, 1, 13, 14]))  # op, num_keys, has_parents, request_id
    if field_at == 1:
        struct.pack_into("<I", body, 1, draw(st.integers(0, 8) | u32))
    else:
        body[field_at] = draw(st.integers(0, 255))
    return bytes(body)


@PROPERTIES
@given(body=sealed_bodies(), room=st.integers(0, 16))
def test_sealed_bodies_decode_only_to_requests_that_encode_back(body, room):
    """Past the length and checksum, the body is checked exactly: anything accepted is
    a request whose encoding is this very frame (no two frames mean one request)."""
    frame = frames.seal(body)
    try:
        req = _decode(frame, room)
    except errors.InvalidArgumentError:
        event("refused")
        return
    event(f"accepted {req.op.name}")
    assert frames.encode_request(req) == frame


@PROPERTIES
@given(data=st.binary(max_size=SERVER_BUF + 64))
def test_arbitrary_bytes_raise_only_invalid_argument(data):
    try:
        req = _decode(data, SERVER_BUF - len(data) if len(data) < SERVER_BUF else 0)
    except errors.InvalidArgumentError:
        return
    frame = frames.encode_request(req)  # accepted: exactly a frame, then zeros
    assert data.startswith(frame) and not data[len(frame) :].strip(b"\0")
