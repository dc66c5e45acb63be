"""BlockPublisher: bounded staging, drops counted, cut chains never continued.

The publisher is shared by the engine's connector and the vLLM connector; its behaviour is
tested here once, through `offer`, `offer_batch`, `stats`, `drain` and `close`. Puts go to
a recording sink (the publisher's only collaborator is the put callable), and once to a
real store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from tests.conftest import require_extra, wait_until

torch = require_extra("torch")

from kvstore.client import Client  # noqa: E402
from kvstore.client.publishing import BlockPublisher, PublishStats  # noqa: E402
from kvstore.errors import UnavailableError  # noqa: E402
from kvstore.keys import KVLayout, Namespace, block_keys  # noqa: E402

SHAPE = (2, 8)  # one staging block: (layers, elements)
KEYS = [bytes([i]) * 32 for i in range(16)]


class _Sink:
    """Records every put (keys, each block's first value, parent); a put waits for `gate`,
    and for `holds[keys[0]]` if there is one, and raises while `failing` is set."""

    def __init__(self) -> None:
        self.puts: list[tuple[list[bytes], list[float], bytes | None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.holds: dict[bytes, threading.Event] = {}
        self.failing = False

    def __call__(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], parent: bytes | None
    ) -> None:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        if keys[0] in self.holds:
            assert self.holds[keys[0]].wait(timeout=30), "the test never released the hold"
        assert all(b.shape == SHAPE for b in blocks)
        self.puts.append((list(keys), [b[0, 0].item() for b in blocks], parent))
        if self.failing:
            raise UnavailableError("the store went away")


def _fill(i: int, out: torch.Tensor) -> None:
    out.fill_(i)


def _publisher(sink: _Sink | None, num_buffers: int) -> BlockPublisher:
    return BlockPublisher(sink, SHAPE, torch.float32, num_buffers)


def _drained_stats(publisher: BlockPublisher) -> PublishStats:
    assert publisher.drain(timeout_s=30)
    return publisher.stats()


def test_staged_blocks_are_put_as_one_chain_after_their_parent():
    sink = _Sink()
    publisher = _publisher(sink, 4)
    assert publisher.offer(KEYS[:3], _fill, None) == 3
    assert publisher.offer(KEYS[3:4], _fill, KEYS[2]) == 1
    assert _drained_stats(publisher) == PublishStats(4, 0, 0, 0)
    assert sink.puts == [(KEYS[:3], [0, 1, 2], None), (KEYS[3:4], [0], KEYS[2])]
    publisher.close()


def test_a_run_in_one_slice_is_put_as_one_tensor_and_a_wrapped_run_as_a_list():
    """A run the ring hands out in one slice reaches the put as that slice (a store client
    checks one array once, `buffers.checked_buffers`); one that wraps, as its blocks."""
    kinds: list[type] = []
    sink = _Sink()

    def put(keys: Sequence[bytes], blocks, parent: bytes | None) -> None:
        kinds.append(type(blocks))
        sink(keys, blocks, parent)

    publisher = _publisher(put, 4)
    assert publisher.offer(KEYS[:1], _fill, None) == 1  # block 0 of the ring
    sink.holds[KEYS[1]] = threading.Event()
    assert publisher.offer(KEYS[1:3], _fill, KEYS[0]) == 2  # blocks 1-2, held
    wait_until(lambda: publisher.stats().num_published_blocks == 1, 30, "the first put")
    assert publisher.offer(KEYS[3:5], _fill, KEYS[2]) == 2  # blocks 3 and 0: wrapped
    sink.holds[KEYS[1]].set()
    assert _drained_stats(publisher) == PublishStats(5, 0, 0, 0)
    assert kinds == [torch.Tensor, torch.Tensor, list]
    assert sink.puts == [
        (KEYS[:1], [0], None),
        (KEYS[1:3], [0, 1], KEYS[0]),
        (KEYS[3:5], [0, 1], KEYS[2]),
    ]
    publisher.close()


def test_blocks_beyond_the_free_buffers_are_dropped_and_counted():
    sink = _Sink()
    sink.gate.clear()  # the network is slow: staged blocks keep their buffers
    publisher = _publisher(sink, 2)
    assert publisher.offer(KEYS[:5], _fill, None) == 2
    assert publisher.offer(KEYS[8:9], _fill, None) == 0  # another chain: no buffer free
    assert publisher.stats() == PublishStats(0, 4, 0, 2)
    sink.gate.set()
    assert _drained_stats(publisher) == PublishStats(2, 4, 0, 0)
    assert publisher.offer(KEYS[10:12], _fill, None) == 2  # the buffers came back
    assert _drained_stats(publisher) == PublishStats(4, 4, 0, 0)
    assert [keys for keys, _, _ in sink.puts] == [KEYS[:2], KEYS[10:12]]
    publisher.close()


def test_a_chain_cut_by_a_drop_is_never_continued_from_any_dropped_block():
    sink = _Sink()
    sink.gate.clear()
    publisher = _publisher(sink, 2)
    assert publisher.offer(KEYS[:4], _fill, None) == 2  # blocks 2 and 3 dropped
    sink.gate.set()
    assert publisher.drain(timeout_s=30)  # every buffer is free again
    assert publisher.offer(KEYS[4:5], _fill, KEYS[3]) == 0  # continues the cut chain
    assert publisher.offer(KEYS[5:6], _fill, KEYS[4]) == 0  # and on from there
    assert publisher.offer(KEYS[6:7], _fill, KEYS[2]) == 0  # a branch from a dropped block
    assert publisher.offer(KEYS[7:8], _fill, KEYS[1]) == 1  # a branch from a published one
    assert _drained_stats(publisher) == PublishStats(3, 5, 0, 0)
    assert [keys for keys, _, _ in sink.puts] == [KEYS[:2], KEYS[7:8]]
    publisher.close()


def test_a_dropped_block_published_later_may_be_continued_again():
    sink = _Sink()
    sink.gate.clear()
    publisher = _publisher(sink, 1)
    assert publisher.offer(KEYS[:2], _fill, None) == 1
    sink.gate.set()
    assert publisher.drain(timeout_s=30)
    assert publisher.offer(KEYS[1:2], _fill, KEYS[0]) == 1  # the dropped block, offered again
    assert publisher.drain(timeout_s=30)
    assert publisher.offer(KEYS[2:3], _fill, KEYS[1]) == 1
    assert _drained_stats(publisher) == PublishStats(3, 1, 0, 0)
    publisher.close()


def test_a_failed_put_is_counted_and_cuts_its_chain_even_for_offers_already_staged():
    sink = _Sink()
    sink.gate.clear()
    sink.failing = True
    publisher = _publisher(sink, 4)
    assert publisher.offer(KEYS[:2], _fill, None) == 2
    assert publisher.offer(KEYS[2:3], _fill, KEYS[1]) == 1  # staged before the put fails
    sink.gate.set()
    assert _drained_stats(publisher) == PublishStats(0, 1, 2, 0)
    assert publisher.offer(KEYS[3:4], _fill, KEYS[0]) == 0  # a branch from a failed block
    assert [keys for keys, _, _ in sink.puts] == [KEYS[:2]]  # the continuation was not put
    publisher.close()


class _BatchReader:
    """A `read_blocks` that records its calls (start, number of blocks) and fills block i of
    the offer with 10 + i."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, outs: torch.Tensor) -> None:
        assert outs.shape[1:] == SHAPE
        self.calls.append((start, len(outs)))
        for j in range(len(outs)):
            outs[j].fill_(10 + start + j)


def test_offer_batch_copies_the_staged_prefix_in_one_call():
    sink, read = _Sink(), _BatchReader()
    publisher = _publisher(sink, 3)
    assert publisher.offer_batch(KEYS[:5], read, None) == 3
    assert publisher.offer_batch(KEYS[5:6], read, KEYS[4]) == 0  # cut: nothing read
    assert _drained_stats(publisher) == PublishStats(3, 3, 0, 0)
    assert read.calls == [(0, 3)]
    assert sink.puts == [(KEYS[:3], [10, 11, 12], None)]
    publisher.close()


def test_a_batch_past_the_end_of_the_pool_is_copied_in_two_calls_in_order():
    sink, read = _Sink(), _BatchReader()
    sink.holds[KEYS[2]] = threading.Event()  # the second put waits: its buffer stays taken
    publisher = _publisher(sink, 4)
    assert publisher.offer(KEYS[:2], _fill, None) == 2
    assert publisher.offer(KEYS[2:3], _fill, None) == 1
    wait_until(lambda: publisher.stats().num_published_blocks == 2, 30, "the first put")
    assert publisher.offer_batch(KEYS[3:7], read, None) == 3  # 3 free: after, then before it
    assert read.calls == [(0, 1), (1, 2)]
    sink.holds[KEYS[2]].set()
    assert _drained_stats(publisher) == PublishStats(6, 1, 0, 0)
    assert sink.puts[-1] == (KEYS[3:6], [10, 11, 12], None)
    publisher.close()


def test_a_failed_copy_gives_its_buffers_back_and_counts_its_blocks_failed():
    publisher = _publisher(_Sink(), 2)

    def broken(start: int, outs: torch.Tensor) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        publisher.offer_batch(KEYS[:3], broken, None)
    assert _drained_stats(publisher) == PublishStats(0, 1, 2, 0)
    assert publisher.offer(KEYS[4:6], _fill, None) == 2
    assert _drained_stats(publisher) == PublishStats(2, 1, 2, 0)
    publisher.close()


def test_each_offer_may_bring_its_own_put():
    first, second = _Sink(), _Sink()
    publisher = _publisher(None, 4)
    assert publisher.offer(KEYS[:1], _fill, None, put_chain=first) == 1
    assert publisher.offer_batch(KEYS[1:3], _BatchReader(), KEYS[0], second) == 2
    assert _drained_stats(publisher) == PublishStats(3, 0, 0, 0)
    assert [keys for keys, _, _ in first.puts] == [KEYS[:1]]
    assert [keys for keys, _, _ in second.puts] == [KEYS[1:3]]
    publisher.close()


def test_close_finishes_queued_puts_then_drops_every_offer():
    sink = _Sink()
    sink.gate.clear()
    publisher = _publisher(sink, 4)
    assert publisher.offer(KEYS[:2], _fill, None) == 2
    closer = threading.Thread(target=publisher.close)
    closer.start()
    sink.gate.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert publisher.stats() == PublishStats(2, 0, 0, 0)
    assert publisher.offer(KEYS[2:3], _fill, None) == 0
    assert publisher.stats() == PublishStats(2, 1, 0, 0)


def test_published_chain_is_the_stored_prefix(store):
    """Through a real store: what was staged is matchable, what was dropped is not stored."""
    namespace = Namespace("test/publisher", KVLayout("float32", 1, 1, 4, 2))  # 64-byte blocks
    keys = block_keys(namespace, list(range(12)))  # 6 blocks
    with Client(store.address) as client:
        ns_id = client.register_namespace(namespace).namespace_id

        def put_chain(keys: Sequence[bytes], blocks: Sequence[torch.Tensor], parent) -> object:
            views = [b.reshape(-1).view(torch.uint8).numpy() for b in blocks]
            return client.put_chain(ns_id, keys, views, parent)

        publisher = BlockPublisher(put_chain, (2, 8), torch.float32, 4)
        assert publisher.offer(keys, _fill, None) == 4
        assert _drained_stats(publisher) == PublishStats(4, 2, 0, 0)
        assert publisher.offer(keys[5:], _fill, keys[4]) == 0
        publisher.close()
        assert client.match(ns_id, keys).num_matched == 4
        assert client.stats().num_blocks == 4
        assert bytes(client.get(ns_id, keys[3:4]).blocks[0]) == bytes(
            torch.full((2, 8), 3.0).view(torch.uint8).numpy()
        )
