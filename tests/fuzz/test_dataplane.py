"""The data plane's frames under arbitrary input (hypothesis): exact encoding, and a node
that ends only the connection that sent a bad frame.

Pure properties of `kvstore.dataplane.frames`: every valid request and reply decodes to
itself; every truncation, extension with nonzero bytes and single bit flip of an encoded
frame raises InvalidArgumentError; any sealed body decodes to nothing but a request that
encodes back to the same frame. Against a node: an adversary holding its own connection's
secret sends arbitrary bytes and arbitrary requests under its request tag and under random
tags; after each example the node has dropped that connection exactly when a frame of it
was bad (one log line), an honest client's connection is the same one and round-trips its
own bytes, and nothing stays leased or reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.checksum import checksum
from kvstore.client import Client
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Kind, Op, Reply, Request, RequestTags, Tags
from kvstore.keys import KEY_BYTES, KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import StoreConfig
from tests.conftest import require_extra, wait_until

NS = Namespace("fuzz-dp", KVLayout("float16", 2, 2, 16, 16))  # 4 KiB blocks
MAX_BATCH_KEYS = 32
TRANSFER_TIMEOUT_S = 3.0  # an adversary's request that never completes ends by then (at
# 1 s, a right put on a two-core host running the whole suite ran past it in two CI runs)
KNOWN_KEYS = tuple(block_keys(NS, list(range(4 * NS.block_tokens))))  # committed at start
SERVER_BUF = frames.request_bytes(MAX_BATCH_KEYS)  # what the node receives a request into
PROPERTIES = settings(max_examples=300, deadline=None)
NODE_FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
keys32 = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)
parent_keys = keys32.map(lambda k: k if any(k) else b"\1" + k[1:])  # zeros mean "no parent"
# Bytes that are not all zero (a zeroed receive buffer holds zeros past a frame).
nonzero = st.builds(
    lambda head, byte, tail: head + bytes([byte]) + tail,
    st.binary(max_size=16),
    st.integers(1, 255),
    st.binary(max_size=16),
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


def _decode(data: bytes, room: int = 0) -> Request:
    """Decodes `data` received into a zeroed buffer `room` bytes longer than it."""
    return frames.decode_request(memoryview(bytearray(data) + bytes(room)))


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


# -- the node against an adversary -------------------------------------------------------------


@dataclass
class Adversary:
    """One connection of a raw UCX worker to the node, holding that connection's secret."""

    rt: Any
    node: Any  # an EmbeddedServer or a `kvstore serve` process: anything with an address
    tags: Tags = field(init=False)
    client_id: int = field(init=False)
    ep: Any = field(init=False)
    last_id: int = 1 << 40  # the highest request id it sent (its own requests count up)

    def __post_init__(self) -> None:
        request = pb.DataPlaneInfoRequest(transport="ucx", client_address=self.rt.worker_address)
        with grpc.insecure_channel(self.node.address) as channel:
            reply = pb_grpc.KVStoreStub(channel).DataPlaneInfo(request, timeout=30)
        self.tags, self.client_id = Tags(reply.connection_secret), reply.client_id
        self.ep = self.rt.call(self._connect(reply.server_address), 10.0)

    async def _connect(self, address: bytes) -> Any:
        ucx_address = self.rt.ucxx.get_ucx_address_from_buffer(address)
        return await self.rt.ctx.create_endpoint_from_worker_address(
            ucx_address, endpoint_error_handling=False
        )

    def send(self, data: bytes, tag: int) -> None:
        if tag == self.tags.request and len(data) <= SERVER_BUF:
            with contextlib.suppress(errors.InvalidArgumentError):
                self.last_id = max(self.last_id, _decode(data, SERVER_BUF - len(data)).request_id)
        buf = np.frombuffer(data or b"\0", np.uint8)[: len(data)]
        self.rt.call(self.ep.send(buf, tag=tag, force_tag=True), 10.0)

    def next_id(self) -> int:
        """An id past every one it sent, as a client's are: the node expects its blocks."""
        self.last_id = min(self.last_id + 1, frames.MAX_REQUEST_ID)
        return self.last_id

    def receive_reply(
        self, tag: int, num_keys: int, timeout_s: float, give_up: Callable[[], bool] = bool
    ) -> Reply | None:
        """The reply the node sends under `tag`; None if none came within `timeout_s` or
        `give_up()` said so first (then this connection must not be used again: the
        receive may still be posted)."""
        buf = bytearray(frames.reply_bytes(num_keys))
        received = self.rt.submit(self.ep.recv(buf, tag=tag, force_tag=True))
        deadline = time.monotonic() + timeout_s
        while not received.done():
            if time.monotonic() > deadline or give_up():
                received.cancel()
                return None
            time.sleep(0.02)
        received.result()
        return frames.decode_reply(memoryview(buf), num_keys)

    def answers(self) -> bool:
        """Whether the node still serves this connection: a GET of an unknown namespace,
        sent after everything before it, gets its (error) reply."""
        request_id = self.next_id()
        probe = Request(Op.GET, request_id, bytes(KEY_BYTES), (bytes(KEY_BYTES),), 1)
        self.send(frames.encode_request(probe), self.tags.request)
        reply_tag = RequestTags.of(self.tags, request_id).reply
        reply = self.receive_reply(reply_tag, 1, TRANSFER_TIMEOUT_S + 5.0)
        return reply is not None and isinstance(reply.error, errors.UnknownNamespaceError)

    def close(self) -> None:
        self.rt.loop.call_soon_threadsafe(lambda: self.ep.abort(period=10**8))


@dataclass
class Node:
    server: EmbeddedServer
    client: Client  # the honest client: one connection for the whole module
    client_id: int
    rt: Any  # the adversary's worker
    adversary: Adversary | None = None
    num_round_trips: int = 0

    def connected(self, client_id: int) -> bool:
        """Whether the node still holds connection `client_id`, once its loop has run the
        drops already scheduled."""
        dp = self.server.dataplanes["ucx"]
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), dp._rt.loop).result(timeout=10)
        return client_id in dp._connections

    def retire_adversary(self) -> None:
        """Ends the adversary's connection as a client does (CLOSE), so that the node does
        not hold it until its idle deadline; the next example makes a fresh one."""
        adv, self.adversary = self.adversary, None
        if adv is not None and self.connected(adv.client_id):
            close = Request(Op.CLOSE, 0, bytes(KEY_BYTES), (), 0)
            adv.send(frames.encode_request(close), adv.tags.request)
            wait_until(lambda: not self.connected(adv.client_id), 10.0, "the connection ends")
        if adv is not None:
            adv.close()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    require_extra("ucxx")
    from kvstore.dataplane.ucx.runtime import UcxRuntime

    store_config = StoreConfig(
        dram_bytes=32 << 20, slab_bytes=1 << 20, max_batch_keys=MAX_BATCH_KEYS
    )
    config = ServerConfig(port=0, dataplane="ucx", transfer_timeout_s=TRANSFER_TIMEOUT_S)
    server = EmbeddedServer(store_config, config)
    with server, Client(server.address, timeout_s=10.0, transport="ucx") as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, list(KNOWN_KEYS), [_content(k) for k in KNOWN_KEYS])
        rt = UcxRuntime("fuzz-adversary", {"NET_DEVICES": "lo"})
        node = Node(server, client, client.data_plane().client_id, rt)
        try:
            yield node
        finally:
            node.retire_adversary()
            rt.stop()


def _content(key: bytes, nbytes: int = NS.block_bytes) -> bytes:
    seed = hashlib.blake2b(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def _round_trip(node: Node) -> None:
    """The honest client, on the connection it had from the start, stores and reads back
    two fresh blocks; then nothing is left leased or reserved."""
    node.num_round_trips += 1
    keys = [
        hashlib.blake2b(b"honest%d.%d" % (node.num_round_trips, i)).digest()[:32] for i in range(2)
    ]
    blocks = [np.frombuffer(_content(k), np.uint8) for k in keys]
    assert node.client.put(NS.id, keys, blocks).num_stored == 2
    out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
    assert node.client.get_into(NS.id, keys, out) == (True, True)
    assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
    assert node.client.data_plane().client_id == node.client_id, "the honest client reconnected"
    node.client.remove(NS.id, keys)
    _wait_quiet(node)


def _wait_quiet(node: Node) -> None:
    """Requests the adversary left hanging end by the transfer deadline: then no lease or
    reservation is open."""
    wait_until(
        lambda: (s := node.client.stats()).num_leases == 0 and s.num_reservations == 0,
        TRANSFER_TIMEOUT_S + 10.0,
        "no lease or reservation open",
    )


request_ids = st.integers(0, 3) | u64


@st.composite
def frame_requests(draw: st.DrawFn) -> Request:
    """A request of any op, id, namespace, key count, block size, parents and checksums."""
    keys = tuple(draw(st.lists(st.sampled_from(KNOWN_KEYS) | keys32, max_size=MAX_BATCH_KEYS + 2)))
    parent = st.none() | st.sampled_from(KNOWN_KEYS) | keys32
    parents = draw(  # one per key; or a count that does not fit the frame's keys
        st.none()
        | st.lists(parent, min_size=len(keys), max_size=len(keys)).map(tuple)
        | st.lists(parent).map(tuple)
    )
    op = draw(st.sampled_from([Op.GET, Op.GET, Op.PUT, Op.PUT, Op.PING, Op.CLOSE]))
    sums = draw(st.lists(u32, min_size=len(keys), max_size=len(keys))) if op is Op.PUT else []
    return Request(
        op,
        draw(request_ids),
        draw(st.sampled_from([NS.id]) | keys32),
        keys,
        draw(st.sampled_from([NS.block_bytes]) | u64),
        parents,
        tuple(sums),
        op is Op.PUT and draw(st.booleans()),  # eager: the node drains what it does not keep
        # GET in parts: a count that divides the block, or any (refused unless it does).
        draw(st.sampled_from([1, 1, 2, 4]) | st.integers(0, 65535)) if op is Op.GET else 1,
    )


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A request frame, damaged or not, or raw bytes."""
    kind = draw(st.sampled_from(["request"] * 4 + ["damaged", "raw", "huge"]))
    if kind == "raw":
        return draw(st.binary(max_size=600))
    if kind == "huge":  # larger than the node's receive buffer
        return bytes(draw(st.integers(SERVER_BUF + 1, SERVER_BUF + 100)))
    frame = frames.encode_request(draw(frame_requests()))
    if kind == "request":
        return frame
    damage = draw(st.sampled_from(["cut", "extend", "flip"]))
    if damage == "cut":
        return frame[: draw(st.integers(0, len(frame) - 1))]
    if damage == "extend":
        return frame + draw(nonzero)
    bit = draw(st.integers(0, 8 * len(frame) - 1))
    flipped = bytearray(frame)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


# Where a frame goes: the connection's request tag, a random tag, or one of its own
# requests' block, reply or done tags (which a PUT of that id may be receiving into).
destinations = st.one_of(
    st.just(("request",)),
    st.just(("request",)),
    st.tuples(st.just("random"), u64),
    st.tuples(st.sampled_from([Kind.BLOCK, Kind.REPLY, Kind.DONE]), request_ids, st.integers(0, 3)),
)


def _tag(adv: Adversary, where: tuple) -> int:
    if where[0] == "request":
        return adv.tags.request
    if where[0] == "random":
        return where[1]
    kind, request_id, index = where
    return adv.tags.tag(kind, request_id, index if kind is Kind.BLOCK else 0)


def _verdict(payload: bytes) -> str:
    """What the node makes of `payload` received under the connection's request tag."""
    if len(payload) > SERVER_BUF:
        return "bad"
    try:
        req = _decode(payload, SERVER_BUF - len(payload))
    except errors.InvalidArgumentError:
        return "bad"
    return req.op.name


def _bad_frame_lines(caplog, client_id: int) -> int:
    return sum(
        "event=ucx_bad_frame" in r.getMessage() and f"client={client_id} " in r.getMessage()
        for r in caplog.records
    )


@NODE_FUZZ
@given(sends=st.lists(st.tuples(destinations, payloads()), min_size=1, max_size=4))
def test_adversary_frames_end_only_its_own_connection(node, caplog, sends):
    """The connection ends exactly when a frame under its request tag is bad (one log
    line) or says CLOSE; frames under other tags change nothing, but a block of one of its
    requests the node has not read yet ends it once it has waited a transfer deadline; a
    GET or PUT it never completes ends by the transfer deadline, with whatever it leased or
    reserved."""
    caplog.set_level(logging.WARNING, logger="kvstore.dataplane")
    caplog.clear()
    if node.adversary is None:
        node.adversary = Adversary(node.rt, node.server)
    adv = node.adversary
    state = "alive"  # then "bad", "closed", or "unsure" once a GET or PUT may end it
    for where, payload in sends:
        adv.send(payload, _tag(adv, where))
        verdict = _verdict(payload) if where[0] == "request" else "unmatched"
        event(f"{where[0]}: {verdict}")
        if where[0] is Kind.BLOCK:  # of a request not read yet: ends it unread (sweeper)
            state = "unsure"
        if verdict == "bad":
            state = "bad" if state == "alive" else "unsure"
            break
        if verdict == "CLOSE":
            state = "closed" if state == "alive" else "unsure"
            break
        if verdict in ("GET", "PUT"):  # may time out, or reuse an id in flight
            state = "unsure"
    if state in ("bad", "closed"):
        wait_until(lambda: not node.connected(adv.client_id), 10.0, "the connection ends")
        assert _bad_frame_lines(caplog, adv.client_id) == (state == "bad")
    if state == "alive":  # the node read every frame before the probe and kept serving
        assert adv.answers(), "a frame that was not bad ended the connection"
        assert _bad_frame_lines(caplog, adv.client_id) == 0
    _wait_quiet(node)
    if state == "unsure":  # a request of it may still end it: a fresh one next
        node.retire_adversary()
    elif not node.connected(adv.client_id):
        adv.close()
        node.adversary = None
    _round_trip(node)


@settings(NODE_FUZZ, max_examples=60)
@given(
    num_keys=st.integers(1, 3),
    blocks=st.lists(
        st.sampled_from(["right"] * 6 + ["altered", "short", "long", "missing"]),
        min_size=3,
        max_size=3,
    ),
    num_present=st.integers(0, 2),
    eager=st.booleans(),
)
def test_adversary_puts_land_only_right_blocks(node, num_keys, blocks, num_present, eager):
    """The adversary's own PUT of `num_present` committed keys, then `num_keys` new ones,
    then block messages under its block tags: right, altered, short or too long for the
    slot, or none. An eager PUT also sends the present keys' blocks (which the node drains).
    The node commits exactly when every new block arrived right; else it commits nothing
    (by the transfer deadline at the latest), and the connection may end. Committed blocks
    keep their bytes whatever an eager PUT sent for them."""
    if node.adversary is not None and node.adversary.last_id >= 1 << 63:
        node.retire_adversary()  # no ids left to count up from
    if node.adversary is None:
        node.adversary = Adversary(node.rt, node.server)
    adv = node.adversary
    node.num_round_trips += 1
    new_keys = [
        hashlib.blake2b(b"adv%d.%d" % (node.num_round_trips, i)).digest()[:32]
        for i in range(num_keys)
    ]
    keys = [*KNOWN_KEYS[:num_present], *new_keys]
    contents = [_content(k) for k in keys]
    sums = tuple(checksum(c) for c in contents)
    request_id = adv.next_id()
    adv.send(
        frames.encode_request(
            Request(Op.PUT, request_id, NS.id, tuple(keys), NS.block_bytes, None, sums, eager)
        ),
        adv.tags.request,
    )
    tags = RequestTags.of(adv.tags, request_id)
    for index in range(num_present) if eager else ():
        adv.send(contents[index][::-1], tags.block(index))  # other bytes: drained, unread
    sent: dict[int, str] = {}
    for index, how in enumerate(blocks[:num_keys], start=num_present):
        if how == "missing":
            continue
        data = {
            "right": contents[index],
            "altered": contents[index][:-1] + bytes([contents[index][-1] ^ 1]),
            "short": contents[index][:-100],
            "long": contents[index] + b"x",
        }[how]
        adv.send(data, tags.block(index))
        sent[index] = how
    # The node answers under DONE once it committed or refused; a block too long for its
    # slot or one missing ends the connection instead (at the transfer deadline).

    def is_gone() -> bool:
        return not node.connected(adv.client_id)

    done = adv.receive_reply(tags.done, 0, TRANSFER_TIMEOUT_S + 5.0, give_up=is_gone)
    is_right = len(sent) == num_keys and all(h == "right" for h in sent.values())
    event(
        f"put: {'right' if is_right else 'wrong'}, eager: {eager}, done: {done and not done.error}"
    )
    assert (done is not None and done.error is None) == is_right
    if done is None:
        wait_until(is_gone, 10.0, "the connection ends")
    _wait_quiet(node)
    assert node.client.get(NS.id, new_keys).found == (is_right,) * num_keys
    if num_present:
        present = node.client.get(NS.id, list(KNOWN_KEYS[:num_present])).blocks
        assert [bytes(b or b"") for b in present] == contents[:num_present]
    if done is None:
        adv.close()
        node.adversary = None
    _round_trip(node)


def test_blocks_of_a_request_never_made_end_their_connection(node, caplog):
    """Blocks of a request the node has read and is not handling are dropped at once.
    Blocks of one it has not read are expected (an eager put's blocks may arrive before
    its request is read); once they have waited a transfer deadline unread, the node drops
    them and ends the connection."""
    caplog.set_level(logging.WARNING, logger="kvstore.dataplane")
    node.retire_adversary()
    sweeper = node.server.dataplanes["ucx"].sweeper
    adv = Adversary(node.rt, node.server)
    adv.send(frames.encode_request(Request(Op.PING, 1, b"", (), 0)), adv.tags.request)
    num_dropped = sweeper.num_dropped
    for i in range(4):
        adv.send(os.urandom(NS.block_bytes), RequestTags.of(adv.tags, 1).block(i))
    wait_until(lambda: sweeper.num_dropped >= num_dropped + 4, 10.0, "read id's blocks drop")
    assert node.connected(adv.client_id)
    for i in range(8):
        adv.send(os.urandom(NS.block_bytes), RequestTags.of(adv.tags, 5).block(i))
    wait_until(
        lambda: not node.connected(adv.client_id), TRANSFER_TIMEOUT_S + 10.0, "the connection ends"
    )
    assert _bad_frame_lines(caplog, adv.client_id) == 1
    assert "error=a frame no request reads" in caplog.text
    wait_until(lambda: sweeper.num_dropped >= num_dropped + 12, 10.0, "its blocks are dropped")
    adv.close()
    _round_trip(node)


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) << 10


def test_frames_under_unmatched_tags_do_not_grow_the_node(store_factory):
    """Found by the fuzzing above: 20,000 frames of 4 KiB (78 MiB) under random tags, from
    one connection that the node then drops. The node's sweeper drops them as they come: it
    may hold some, not all of them."""
    require_extra("ucxx")
    from kvstore.dataplane.ucx.runtime import UcxRuntime

    store = store_factory("--dram-bytes", "64MiB", "--slab-bytes", "4MiB")
    rt = UcxRuntime("fuzz-flood", {"NET_DEVICES": "lo"})
    try:
        adv = Adversary(rt, store)
        before = _rss_bytes(store.proc.pid)
        frame = os.urandom(4 << 10)
        rng = np.random.default_rng(0)
        adv.send(frames.encode_request(Request(Op.PING, 1, b"", (), 0)), adv.tags.request)
        for _ in range(20_000):
            adv.send(frame, int(rng.integers(0, 2**63)))
        adv.send(b"garbage", adv.tags.request)  # a bad frame: the node drops the connection
        wait_until(lambda: "event=ucx_bad_frame" in store.log(), 10.0, "the connection ends")
        adv.close()
        growth = _rss_bytes(store.proc.pid) - before
        assert growth < 16 << 20, f"the node grew by {growth >> 20} MiB"
    finally:
        rt.stop()
