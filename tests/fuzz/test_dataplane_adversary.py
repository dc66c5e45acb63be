"""The data plane against an adversary (hypothesis): a node that ends only the connection
that sent a bad frame. An adversary holding its own connection's secret (`dataplane_cases`)
sends arbitrary bytes and arbitrary requests under its request tag and under random tags, and
PUTs of right and wrong blocks; after each example the node has dropped that connection
exactly when a frame of it was bad (one log line), an honest client's connection is the same
one and round-trips its own bytes, and nothing stays leased or reserved. Blocks of a request
never made end their connection, and a flood of frames under unmatched tags does not grow the
node.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.client import Client
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Kind, Op, Request, RequestTags
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import StoreConfig
from tests.conftest import require_extra, wait_until
from tests.fuzz.dataplane_cases import (
    KNOWN_KEYS,
    MAX_BATCH_KEYS,
    NODE_FUZZ,
    NS,
    SERVER_BUF,
    TRANSFER_TIMEOUT_S,
    Adversary,
    Node,
    _content,
    _decode,
    keys32,
    nonzero,
    u32,
    u64,
)

# -- the node against an adversary -------------------------------------------------------------


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
