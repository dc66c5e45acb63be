"""Property-based checks of the two bounds every plane and streaming RPC inherits
(`kvstore.bounds`), driven by random sequences of what hostile and honest clients do, over
real sockets: unproven sockets stay within their bounds, a socket that spoke is never shed
for a newcomer, a newcomer is refused only where none in its way is silent, and a shed
socket proves nothing; stream slots never exceed theirs and refuse exactly at them."""

from __future__ import annotations

import socket
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.bounds import StreamLimits, StreamSlots, UnprovenSockets

PEERS = ("10.0.0.1", "10.0.0.2", None)  # None: a Unix socket (no per-peer bound)
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("connect"), st.sampled_from(PEERS)),
        st.tuples(st.sampled_from(["speak", "read", "prove", "close"]), st.integers(0, 63)),
    ),
    max_size=60,
)


class _Pair:
    """A socket as the node holds it, its client's end, and what the client did."""

    def __init__(self, peer: str | None) -> None:
        self.node, self.client = socket.socketpair()
        self.peer = peer
        self.spoke = False  # bytes sent that the node has not read

    def shed(self) -> bool:
        self.client.setblocking(False)
        try:
            return self.client.recv(1) == b""
        except BlockingIOError:
            return False

    def close(self) -> None:
        self.node.close()
        self.client.close()


@settings(max_examples=60, deadline=None)
@given(ACTIONS)
def test_unproven_sockets_shed_only_silent_ones_and_keep_their_bounds(actions):
    pool = UnprovenSockets("test", max_sockets=6, max_per_peer=3)
    pairs: list[_Pair] = []
    try:
        for verb, arg in actions:
            live = [i for i, p in enumerate(pairs) if p.node in pool]
            if verb == "connect":
                pair = _Pair(arg)
                before = {i: pairs[i].node for i in live}
                admitted = pool.admit(pair.node, arg)
                pairs.append(pair)
                gone = [i for i, node in before.items() if node not in pool]
                for i in gone:  # shed: silent, and its client sees the node close
                    assert not pairs[i].spoke
                    assert pairs[i].shed()
                    assert not pool.prove(pairs[i].node)  # its hello would claim nothing
                assert len(gone) <= 1
                if not admitted:  # every socket in its way has bytes waiting
                    same = [i for i in live if pairs[i].peer == arg] if arg else []
                    crowd = same if len(same) >= 3 else live
                    assert all(pairs[i].spoke for i in crowd)
            elif live:
                i = live[arg % len(live)]
                if verb == "speak":
                    pairs[i].client.send(b"h")
                    pairs[i].spoke = True
                elif verb == "read" and pairs[i].spoke:
                    pairs[i].node.recv(64)
                    pairs[i].spoke = False
                elif verb == "prove":
                    assert pool.prove(pairs[i].node)
                    assert pairs[i].node not in pool
                elif verb == "close":
                    pool.discard(pairs[i].node)
            members = [p for p in pairs if p.node in pool]
            assert len(members) == len(pool) <= 6
            per_peer = Counter(p.peer for p in members if p.peer is not None)
            assert max(per_peer.values(), default=0) <= 3
    finally:
        for pair in pairs:
            pair.close()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abc")), max_size=80))
def test_stream_slots_refuse_exactly_at_their_bounds(steps):
    slots = StreamSlots(StreamLimits(max_streams_per_client=3, max_streams=5), "test")
    held: dict[str, list] = {c: [] for c in "abc"}
    for is_open, client in steps:
        total = sum(len(v) for v in held.values())
        if is_open:
            at_bound = len(held[client]) >= 3 or total >= 5
            if at_bound:
                with pytest.raises(errors.TooManyStreamsError):
                    slots.take(client)
            else:
                held[client].append(slots.take(client))
        elif held[client]:
            slot = held[client].pop()
            slot.release()
            slot.release()  # idempotent
        assert len(slots) == sum(len(v) for v in held.values()) <= 5
