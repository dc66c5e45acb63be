"""Block bytes on a stream socket (`kvstore.dataplane.tcp.streams`), over a real socket pair:
every byte in order, each view summed as a whole, and a dead or late peer an error."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.dataplane.tcp import streams

SIZES = [100 << 10, 300 << 10, 0, 50 << 10, 1 << 20, 7]  # across piece boundaries


def _views(seed: int) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, n, dtype=np.uint8)).cast("B") for n in SIZES]


def test_pieces_cover_every_view_in_order_in_runs_of_at_most_a_piece():
    views = _views(1)
    runs = list(streams.pieces(views))
    assert all(0 < sum(p.nbytes for _, p in run) <= streams.PIECE_BYTES for run in runs)
    assert all(sum(p.nbytes for _, p in run) == streams.PIECE_BYTES for run in runs[:-1])
    flat = [(i, bytes(p)) for run in runs for i, p in run]
    for i, view in enumerate(views):
        assert b"".join(b for j, b in flat if j == i) == bytes(view)
    assert [i for i, _ in flat] == sorted(i for i, _ in flat)


def test_what_one_side_sends_summed_the_other_receives_summed():
    sent, into = _views(2), [memoryview(bytearray(n)) for n in SIZES]
    send_sums, receive_sums = [0] * len(SIZES), [0] * len(SIZES)
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(5.0)
        sender = threading.Thread(
            target=streams.send_summed, args=(left, sent, send_sums, time.monotonic() + 30)
        )
        sender.start()
        streams.receive_summed(right, into, receive_sums, time.monotonic() + 30)
        sender.join(timeout=30)
        assert left.gettimeout() == 5.0  # the socket's own timeout is put back
    assert [bytes(v) for v in into] == [bytes(v) for v in sent]
    assert send_sums == receive_sums == [checksum(v) for v in sent]


def test_a_closed_or_late_peer_is_an_error_not_a_wait():
    left, right = socket.socketpair()
    with right:
        left.sendall(b"x" * 10)
        left.close()
        with pytest.raises(ConnectionError):  # 10 bytes of 20, then the end of the stream
            streams.receive_summed(right, [memoryview(bytearray(20))], [0], time.monotonic() + 30)
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(TimeoutError):  # nothing comes, and the deadline has passed
            streams.receive_summed(right, [memoryview(bytearray(20))], [0], time.monotonic())
        with pytest.raises(TimeoutError):
            streams.drain(right, 20, bytearray(8), time.monotonic())


class _CountingSocket(socket.socket):
    """A real socket that notes, per sendmsg call, the bytes offered and the bytes sent."""

    calls: list[tuple[int, int]]

    def sendmsg(self, buffers, *args):  # type: ignore[override]
        buffers = list(buffers)
        sent = super().sendmsg(buffers, *args)
        self.calls.append((sum(memoryview(b).nbytes for b in buffers), sent))
        return sent


def test_a_large_send_goes_in_calls_of_at_most_call_bytes_every_byte_in_order():
    views = [*_views(3), memoryview(np.arange(3 << 20, dtype=np.uint8)).cast("B")]
    total = sum(v.nbytes for v in views)
    left, right = socket.socketpair()
    sender = _CountingSocket(fileno=left.detach())
    sender.calls = []
    got = bytearray()

    def receive() -> None:
        while len(got) < total:
            got.extend(right.recv(1 << 20))

    with sender, right:
        reader = threading.Thread(target=receive)
        reader.start()
        streams.send_all(sender, views, time.monotonic() + 30)
        reader.join(timeout=30)
    assert bytes(got) == b"".join(bytes(v) for v in views)
    assert sum(sent for _, sent in sender.calls) == total
    assert max(offered for offered, _ in sender.calls) == streams.CALL_BYTES
