"""The same-host data plane's LANDED notes and copy helpers: a note the socket cannot take
now is not sent at all; a client takes a note of every unit of a GET in parts, and a message
longer than any a node may send breaks the stream; against a real node, a GET whose first
run lands last is noted at once and lands whole, and a large GET takes copy helpers only
from cores beyond the two it keeps busy.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import ClassVar

import numpy as np
import pytest

from kvstore.dataplane import frames
from kvstore.dataplane.frames import Reply
from kvstore.dataplane.shm import server as shm_server
from kvstore.dataplane.sockets import messages as socket_messages
from tests.dataplane import shm_cases as cases
from tests.dataplane import socket_planes as planes
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet = planes.chain, planes.blocks, planes.quiet
SHM = planes.Plane("shm")
_client = SHM.client
node = cases.node  # a fixture: this module's node


def test_a_note_the_socket_cannot_take_now_is_not_sent_at_all():
    """The node never waits under a lease for a client that does not read: `try_send`
    sends a whole message or nothing, so the stream stays whole either way."""
    node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    node_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    note = socket_messages.encode_landed(1, 0, b"\1" * 100)
    sent = 0
    while socket_messages.try_send(node_end, note):
        sent += 1
        assert sent < 100_000, "the socket never filled"
    node_end.close()
    received = 0
    with contextlib.suppress(ConnectionError):
        while True:
            data, _ = socket_messages.receive(client_end, 1 << 10)
            assert socket_messages.decode_landed(data) == (1, 0, b"\1" * 100)
            received += 1
    assert received == sent > 0
    client_end.close()


def test_a_note_of_every_unit_of_a_get_is_taken_and_a_longer_message_breaks_the_stream():
    """Runs landing out of order are noted together (`shm_server._Notes`): with a helper
    held up on one, a note can name every unit of a GET in parts, many more than its
    reply's bytes (a load of 256 keys in 8 parts: 2,048 flags; its reply, 1,310 bytes). The
    client takes such a note; a message longer than any a node may send is a broken stream
    (ConnectionError: the connection is dropped), not an error of the call, which would
    leave the rest of it to be read as the next message."""
    num_keys, units = 256, 256 * 8
    assert units > frames.reply_bytes(num_keys)
    node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with node_end, client_end:
        socket_messages.send(node_end, socket_messages.encode_landed(9, 0, b"\1" * units))
        flags = tuple([1] * num_keys)
        sums = tuple(range(num_keys))
        reply = Reply(flags, 0, NS.block_bytes, checksums=sums)
        socket_messages.send(node_end, socket_messages.encode_reply(reply))
        notes: list = []
        got = socket_messages.receive_reply(client_end, num_keys, True, lambda *n: notes.append(n))
        assert notes == [(9, 0, b"\1" * units)]
        assert (got.flags, got.checksums) == (flags, sums)
        too_long = socket_messages.encode_landed(9, 0, b"\1" * (frames.MAX_BLOCKS + 1))
        socket_messages.send(node_end, too_long)
        with pytest.raises(ConnectionError, match="out of step"):
            socket_messages.receive_reply(client_end, num_keys, True, None)


class _FirstRunLast(shm_server._Notes):
    """The node's notes of a GET whose first run lands after every other but the last, as
    when a helper holding it is off its core: one note then names nearly every unit."""

    largest: int = 0

    def landed(self, k: int) -> None:
        if k == 0:
            return  # said below, once the others are in
        super().landed(k)
        if k == len(self._runs) - 2:
            super().landed(0)
            _FirstRunLast.largest = max(_FirstRunLast.largest, self._said)


def test_a_get_whose_first_run_lands_last_is_noted_at_once_and_lands_whole(node, monkeypatch):
    """Against a real node: a GET whose first run is held back (as a helper off its core
    holds it) is noted in one note of more flags than its reply has bytes; the client takes
    it, every part lands whole and checked, and the connection's next call is in step."""
    keys, blocks = _chain(8, 33), _blocks(8, 33)
    segments = 256  # 2,048 units of 128 bytes: far more flags than the reply has bytes
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", 128)  # a run per unit
    monkeypatch.setattr(shm_server, "_Notes", _FirstRunLast)
    _FirstRunLast.largest = 0
    with _client(node) as client:
        client.put_chain(NS.id, keys, blocks)
        dataplane = client.data_plane()
        size = NS.block_bytes // segments
        landed = client.buffer(len(keys) * NS.block_bytes)  # part s of key i at (s, i)
        parts = [
            [landed[(s * len(keys) + i) * size :][:size] for i in range(len(keys))]
            for s in range(segments)
        ]
        found = dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes).result()
        assert found == (True,) * len(keys)
        for i, block in enumerate(blocks):
            assert (np.concatenate([parts[s][i] for s in range(segments)]) == block).all()
        assert _FirstRunLast.largest > frames.reply_bytes(len(keys))
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]  # the stream still in step
        assert client.get_into(NS.id, keys, out) == (True,) * len(keys)
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        client.remove(NS.id, keys)
    _quiet(node)


class _Copiers(shm_server._Notes):
    """The node's notes of a GET, recording which threads copied its runs."""

    threads: ClassVar[set[int]] = set()

    def landed(self, k: int) -> None:
        _Copiers.threads.add(threading.get_ident())
        super().landed(k)


@pytest.mark.parametrize("cores", [2, 3])
def test_a_get_takes_copy_helpers_only_from_cores_beyond_the_two_it_keeps_busy(
    node, monkeypatch, cores
):
    """A large get keeps the node's copy and the client's check busy: on a host of two
    cores its runs are all copied on the connection's thread, on three by it and at most
    one helper; every block lands whole either way."""
    server = node.dataplanes["shm"]
    monkeypatch.setattr(shm_server, "GET_SHARED_BYTES", 2 * NS.block_bytes)
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", NS.block_bytes)  # a run per block
    monkeypatch.setattr(server, "get_helpers", shm_server.get_helpers(cores))
    monkeypatch.setattr(server._crew, "helpers", 3)
    monkeypatch.setattr(shm_server, "_Notes", _Copiers)
    _Copiers.threads = set()
    keys, blocks = _chain(8, 34), _blocks(8, 34)
    with _client(node) as client:
        client.put_chain(NS.id, keys, blocks)
        landed = client.buffer(len(keys) * NS.block_bytes)  # one call, straight in
        out = list(landed.reshape(len(keys), NS.block_bytes))
        for _ in range(20):
            landed[:] = 0
            assert client.get_into(NS.id, keys, out) == (True,) * len(keys)
            assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        client.remove(NS.id, keys)
    assert 1 <= len(_Copiers.threads) <= cores - 1
    _quiet(node)
