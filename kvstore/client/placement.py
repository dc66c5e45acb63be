"""Placement: which nodes of a pool a put's blocks go to.

A put is cut into pieces that never straddle a chain group (`CHAIN_GROUP_BLOCKS` blocks
along the chain), and each piece goes to one node, chosen by rendezvous hashing of the
piece's first key weighted by the nodes' capacities (each node scores `-ln(u) / weight`,
`u` uniform from a hash of the key and the node, and the lowest score wins):

- every node receives new pieces in proportion to what it can hold, so every node keeps
  its blocks about equally long, and the pool evicts close to what one node of all the
  capacity would (a writer's own node taking all it writes leaves small nodes thrashing
  beside large ones, and nodes whose writers are busy evicting what idle nodes would
  keep);
- a long prefix lands on several nodes, which serve it in parallel;
- a piece goes to the same node from every writer while the pool's members stay the same,
  and a member joining or leaving moves only the pieces it wins or held.

Locality: the writer's own node takes a put's first piece (the head of what it wrote, the
part its next turn reads first) where it is one of that piece's two best nodes and no
smaller than the best (so it never takes more than its share for being small); later
pieces go to their best node, so a long prefix spreads even over two nodes. Neighbouring
pieces that land on one node go in one put.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition, chain_groups

_HASH_SPAN = float(1 << 64)


class Piece(NamedTuple):
    """Keys `start` to `stop` (of a put's keys) go to the node at `address`; `position` is
    where the first of them sits in its chain (None at a chain's root, or where the put
    did not say)."""

    start: int
    stop: int
    address: str
    position: ChainPosition | None


def place(
    keys: Sequence[bytes],
    position: ChainPosition | None,
    nodes: Mapping[str, int],
    home: str,
) -> list[Piece]:
    """The pieces of a put of chain `keys`, the first at `position` (None: the chain's
    root), over `nodes` (address -> capacity in bytes), `home` being the writer's own."""
    if not keys:
        return []
    if not nodes:
        return [Piece(0, len(keys), home, position)]
    depth = 0 if position is None else position.depth
    groups = chain_groups(keys, position)
    pieces: list[Piece] = []
    start = 0
    while start < len(keys):
        stop = min(len(keys), start + CHAIN_GROUP_BLOCKS - (depth + start) % CHAIN_GROUP_BLOCKS)
        here = position if start == 0 else ChainPosition(depth + start, groups[start])
        address = choose(keys[start], nodes, home if start == 0 else None)
        if pieces and pieces[-1].address == address:  # one put continues the chain
            pieces[-1] = pieces[-1]._replace(stop=stop)
        else:
            pieces.append(Piece(start, stop, address, here))
        start = stop
    return pieces


def choose(key: bytes, nodes: Mapping[str, int], home: str | None) -> str:
    """The node of `nodes` a piece that starts at `key` goes to: its best, or `home`
    where that is one of the two best and no smaller than the best."""
    weights = {a: float(c) for a, c in nodes.items()} if any(nodes.values()) else {}
    ranked = sorted(nodes, key=lambda a: (_score(key, a, weights.get(a, 1.0)), a))
    best = ranked[0]
    if home in ranked[:2] and weights.get(home, 1.0) >= weights.get(best, 1.0):
        return home
    return best


def _score(key: bytes, address: str, weight: float) -> float:
    if weight <= 0:
        return math.inf
    digest = hashlib.blake2b(key + address.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / _HASH_SPAN
    return -math.log(u) / weight
