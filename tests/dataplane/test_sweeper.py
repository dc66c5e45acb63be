"""The sweeper takes out of a real UCX worker the messages no receive will match, and only
those (kvstore.dataplane.ucx.sweeper): two workers in this process, one sending to the other."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.dataplane.ucx.sweeper import SCRATCH_BYTES, Sweeper
from tests.conftest import require_extra, wait_until

EXPECTED = 7  # the one tag the node under test expects
GRACE_S = 5.0


@pytest.fixture
def pair():
    require_extra("ucxx")
    from kvstore.dataplane.ucx.runtime import UcxRuntime

    node = UcxRuntime("sweep-node", {"NET_DEVICES": "lo"})
    peer = UcxRuntime("sweep-peer", {"NET_DEVICES": "lo"})

    async def connect():
        address = peer.ucxx.get_ucx_address_from_buffer(node.worker_address)
        return await peer.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=False
        )

    ep = peer.call(connect(), 10.0)
    yield node, peer, ep
    peer.loop.call_soon_threadsafe(lambda: ep.abort(period=10**8))
    peer.stop()
    node.stop()


def _send(peer, ep, data: bytes, tag: int) -> None:
    """Sends without waiting: a large message's send ends only once it is received."""
    peer.submit(ep.send(np.frombuffer(data, np.uint8), tag=tag, force_tag=True))


def _arrived(node, tag: int) -> None:
    """Waits until a message under `tag` is queued at `node`: messages of one endpoint arrive
    in order, so every one sent before it has too."""
    from ucxx.types import Tag

    wait_until(lambda: node.ctx.worker.tag_probe(Tag(tag)).matched, 10.0, f"tag {tag} arrives")


def _receive(node, size: int, tag: int, timeout_s: float = 5.0) -> bytes:
    buf = np.zeros(size, np.uint8)
    node.call(node.ctx.recv(buf, tag), timeout_s)
    return buf.tobytes()


def test_unexpected_messages_of_any_size_are_dropped(pair):
    node, peer, ep = pair
    sweeper = Sweeper(node.ctx.worker, lambda tag: tag == EXPECTED, GRACE_S)
    sizes = [1, 4 << 10, SCRATCH_BYTES + 1, 4 << 20]  # eager, and larger than scratch
    for i, size in enumerate(sizes):
        _send(peer, ep, os.urandom(size), 100 + i)
    _arrived(node, 100 + len(sizes) - 1)
    swept = node.call(sweeper.sweep(now=0.0), 10.0)
    assert swept.num_dropped == len(sizes)
    assert swept.stale_tag is None
    assert node.call(sweeper.sweep(now=0.0), 10.0).num_dropped == 0
    assert sweeper.num_dropped == len(sizes)


def test_the_sweep_stops_at_an_expected_message_until_its_grace_ends(pair):
    node, peer, ep = pair
    sweeper = Sweeper(node.ctx.worker, lambda tag: tag == EXPECTED, GRACE_S)
    _send(peer, ep, b"garbage", 99)
    _send(peer, ep, b"wanted", EXPECTED)
    _send(peer, ep, b"behind", 98)
    _arrived(node, 98)
    assert node.call(sweeper.sweep(now=0.0), 10.0).num_dropped == 1  # up to the expected one
    assert node.call(sweeper.sweep(now=GRACE_S - 0.1), 10.0).num_dropped == 0
    assert _receive(node, 6, EXPECTED) == b"wanted"  # it is still there for its receive
    assert node.call(sweeper.sweep(now=GRACE_S), 10.0).num_dropped == 1  # what it shielded


def test_an_expected_message_past_its_grace_is_dropped_and_reported(pair):
    node, peer, ep = pair
    sweeper = Sweeper(node.ctx.worker, lambda tag: tag == EXPECTED, GRACE_S)
    _send(peer, ep, b"stuck", EXPECTED)
    _send(peer, ep, b"behind", 98)
    _arrived(node, 98)
    assert node.call(sweeper.sweep(now=10.0), 10.0).num_dropped == 0
    swept = node.call(sweeper.sweep(now=10.0 + GRACE_S), 10.0)
    assert swept == (2, EXPECTED)


def test_a_receive_posted_before_the_sweep_gets_its_message(pair):
    node, peer, ep = pair
    sweeper = Sweeper(node.ctx.worker, lambda tag: False, GRACE_S)  # expects nothing
    buf = np.zeros(5, np.uint8)
    received = node.submit(node.ctx.recv(buf, 42))
    _send(peer, ep, b"mine!", 42)
    received.result(timeout=5.0)
    assert node.call(sweeper.sweep(now=0.0), 10.0).num_dropped == 0
    assert buf.tobytes() == b"mine!"


def test_a_sweep_takes_at_most_its_limit(pair):
    node, peer, ep = pair
    sweeper = Sweeper(node.ctx.worker, lambda tag: False, GRACE_S)
    for i in range(100):
        _send(peer, ep, b"x" * 64, 1000 + i)
    _arrived(node, 1099)
    assert node.call(sweeper.sweep(now=0.0, limit=40), 10.0).num_dropped == 40
    assert node.call(sweeper.sweep(now=0.0), 10.0).num_dropped == 60
