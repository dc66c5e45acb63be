"""Placed puts over real nodes and a real Redis: a long chain put through the pool client
is spread over the nodes as placement says, found whole by one lookup and read back byte
for byte from several nodes; a chain continued on another node than its head is found
whole; a piece whose node died goes to another; and a stated chain position that cannot be
is refused over the wire, changing nothing; the rest of a chain is found and read where
its lookup states where it starts."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.client.placement import place
from kvstore.client.pool_client import PoolClient
from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition
from tests.cluster.test_pool_client import _hits
from tests.cluster.test_pool_nodes import NS, _chain, _serve
from tests.conftest import wait_until

DEADLINE_S = 1.0
LONG = 4 * CHAIN_GROUP_BLOCKS


def _payload(i: int) -> np.ndarray:
    return np.full(NS.block_bytes, (i * 13 + 5) % 251, np.uint8)


def _pool_of(store_factory, redis_url: str, n: int):
    nodes = [_serve(store_factory, redis_url, f"n{i}") for i in range(n)]
    with Client(nodes[0].address, transport="grpc") as c:
        wait_until(lambda: len(c.pool_status().members) == n, 10.0, "every node a member")
        members = {m.addresses["grpc"]: sum(m.capacity.values()) for m in c.pool_status().members}
    return nodes, members


def _owners(keys: list[bytes], members: dict[str, int], home: str) -> set[str]:
    return {piece.address for piece in place(keys, None, members, home)}


def _num_blocks(address: str) -> int:
    with Client(address, transport="grpc") as c:
        return c.stats().num_blocks


def _read_back(pool: PoolClient, ns_id: bytes, keys: list[bytes]) -> bool:
    got = pool.get(ns_id, keys).blocks
    return all(b is not None and bytes(b) == _payload(i).tobytes() for i, b in enumerate(got))


def _located(pool: PoolClient, ns_id: bytes, keys: list[bytes]) -> int:
    return pool.locate(ns_id, keys).num_located


def test_a_long_chain_is_spread_over_the_nodes_and_read_from_them(store_factory, redis_single):
    nodes, members = _pool_of(store_factory, redis_single.url, 3)
    home = nodes[0].address
    seed = next(s for s in range(100) if len(_owners(_chain(LONG, s), members, home)) == 3)
    keys = _chain(LONG, seed)  # a chain placement spreads over all three (ports vary)
    expected = {n.address: 0 for n in nodes}
    for piece in place(keys, None, members, home):
        expected[piece.address] += piece.stop - piece.start
    with PoolClient([home], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        ns_id = pool.register_namespace(NS).namespace_id
        result = pool.put_chain(ns_id, keys, [_payload(i) for i in range(LONG)])
        assert result.num_stored == LONG
        assert {n.address: _num_blocks(n.address) for n in nodes} == expected
        wait_until(lambda: _located(pool, ns_id, keys) == LONG, 5.0, "every piece filed")
        before = {a: _hits(a) for a in expected}
        assert _read_back(pool, ns_id, keys)
        served = {a for a in expected if _hits(a) > before[a]}
    assert served == {a for a, count in expected.items() if count}  # each holder its share


def test_a_chain_continued_away_from_its_head_is_found_whole(store_factory, redis_single):
    nodes, _ = _pool_of(store_factory, redis_single.url, 3)
    keys = _chain(LONG, seed=1)
    head = 40  # the continuation starts inside the second group
    with PoolClient([nodes[0].address], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        ns_id = pool.register_namespace(NS).namespace_id
        pool.put_chain(ns_id, keys[:head], [_payload(i) for i in range(head)])
    with PoolClient([nodes[2].address], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        pool.register_namespace(NS)
        rest = [_payload(i) for i in range(head, LONG)]
        position = ChainPosition.of(keys, head)
        result = pool.put_chain(ns_id, keys[head:], rest, keys[head - 1], position)
        assert result.num_stored == LONG - head
        wait_until(lambda: _located(pool, ns_id, keys) == LONG, 5.0, "both puts filed")
        assert _read_back(pool, ns_id, keys)
        for start in (head, 2 * CHAIN_GROUP_BLOCKS, 7):  # the rest of a chain, looked up alone
            position = ChainPosition.of(keys, start)
            assert pool.locate(ns_id, keys[start:], position).num_located == LONG - start
            got = pool.get(ns_id, keys[start:], position).blocks
            assert [bytes(b or b"") for b in got] == [
                _payload(i).tobytes() for i in range(start, LONG)
            ]


def test_a_piece_whose_node_died_goes_to_another(store_factory, redis_single):
    nodes, members = _pool_of(store_factory, redis_single.url, 3)
    home, dead = nodes[0].address, nodes[2].address
    seed = next(
        s
        for s in range(100)
        if dead in {p.address for p in place(_chain(LONG, s), None, members, home)}
    )
    keys = _chain(LONG, seed)
    nodes[2].kill()  # still a member until its TTL runs out
    with PoolClient([home], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        ns_id = pool.register_namespace(NS).namespace_id
        result = pool.put_chain(ns_id, keys, [_payload(i) for i in range(LONG)])
        assert result.num_stored == LONG
        assert pool.failing_nodes == [dead]
        wait_until(lambda: _located(pool, ns_id, keys) == LONG, 5.0, "every piece filed")
        assert _read_back(pool, ns_id, keys)


def test_a_position_that_cannot_be_is_refused_over_the_wire(store_factory, redis_single):
    (node,), _ = _pool_of(store_factory, redis_single.url, 1)
    keys = _chain(8, seed=2)
    blocks = [_payload(i) for i in range(8)]
    with Client(node.address, transport="grpc") as c:
        ns_id = c.register_namespace(NS).namespace_id
        with pytest.raises(errors.InvalidArgumentError):
            c.put_chain(ns_id, keys[3:], blocks[3:], keys[2], ChainPosition(3, keys[0][:8]))
        with pytest.raises(errors.InvalidArgumentError):
            c.put_chain(
                ns_id, keys[3:], blocks[3:], keys[2], ChainPosition(CHAIN_GROUP_BLOCKS, keys[0])
            )
        assert c.stats().num_blocks == 0
        with pytest.raises(errors.InvalidArgumentError):
            c.locate(ns_id, keys[3:], ChainPosition(3, keys[3]))  # a group opens at 0, 32, ...
        assert c.put_chain(ns_id, keys, blocks).num_stored == 8  # and it serves on


def test_a_client_reads_its_own_puts_before_the_index_files_them(store_factory, redis_single):
    """Nodes that file their changes only every 30 s: the index knows nothing of a chain
    just put, yet the client that put it matches and reads it whole at once, from every
    node it placed pieces on; another client finds only what its home node holds."""
    slow = ("--cluster-flush-s", "30")  # files at start, then every 30 s; renews on time
    nodes = [_serve(store_factory, redis_single.url, f"n{i}", *slow) for i in range(2)]
    home = nodes[0].address
    with Client(home, transport="grpc") as c:
        wait_until(lambda: len(c.pool_status().members) == 2, 10.0, "both nodes members")
        members = {m.addresses["grpc"]: sum(m.capacity.values()) for m in c.pool_status().members}
    seed = next(s for s in range(100) if len(_owners(_chain(LONG, s), members, home)) == 2)
    keys = _chain(LONG, seed)  # placed on both nodes
    with PoolClient([home], read_deadline_s=DEADLINE_S, hot_reads=0) as writer:
        ns_id = writer.register_namespace(NS).namespace_id
        writer.put_chain(ns_id, keys, [_payload(i) for i in range(LONG)])
        assert _located(writer, ns_id, keys) == 0  # not filed yet
        assert writer.match(ns_id, keys).num_matched == LONG
        assert _read_back(writer, ns_id, keys)
    with PoolClient([home], read_deadline_s=DEADLINE_S, hot_reads=0) as other:
        other.register_namespace(NS)
        on_home = _num_blocks(home)
        assert 0 < on_home < LONG
        assert other.match(ns_id, keys).num_matched <= on_home  # the rest is not filed yet
