"""The pool client against real nodes and a real Redis: a chain its home node holds whole
is read from it alone, with no lookup; a chain two other nodes hold loads from both at
once, byte for byte; a chain read twice from its one holder gets a copy on the reader's
node, and no more than the budget; a holder SIGKILLed or frozen (SIGSTOP) mid-way costs at most one
read deadline and its blocks come from the other holder; a node that failed is left out
instead of dialled per request; and where no node or Redis answers, every call is misses,
never an error."""

from __future__ import annotations

import logging
import signal
import time

import numpy as np

from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from tests.cluster.test_pool_nodes import NS, _chain, _serve
from tests.conftest import wait_until

DEADLINE_S = 1.0


def _payload(i: int) -> np.ndarray:
    return np.full(NS.block_bytes, (i * 7 + 3) % 251, np.uint8)


def _two_holders(store_factory, redis_url: str, n: int):
    """A chain of `n` blocks on nodes n1 and n2, and a node n0 that holds none of it (the
    readers' home: what it held would be read from it alone)."""
    nodes = [_serve(store_factory, redis_url, name) for name in ("n0", "n1", "n2")]
    keys = _chain(n)
    for node in nodes[1:]:
        with Client(node.address, transport="grpc") as c:
            ns_id = c.register_namespace(NS).namespace_id
            c.put_chain(ns_id, keys, [_payload(i) for i in range(n)])
    return nodes, keys, ns_id


def _hits(address: str) -> int:
    with Client(address, transport="grpc") as c:
        return c.stats().hits


def _whole(pool: PoolClient, ns_id: bytes, keys: list[bytes]) -> bool:
    got = pool.get(ns_id, keys).blocks
    return all(b is not None and bytes(b) == _payload(i).tobytes() for i, b in enumerate(got))


def _located_on_both(pool: PoolClient, ns_id: bytes, keys: list[bytes]) -> bool:
    located = pool.locate(ns_id, keys)
    return located.num_located == len(keys) and all(len(b) == 2 for b in located.blocks)


def test_replicas_load_in_parallel_byte_for_byte(store_factory, redis_single):
    (n0, n1, n2), keys, ns_id = _two_holders(store_factory, redis_single.url, 128)
    with PoolClient([n0.address], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        pool.register_namespace(NS)
        wait_until(lambda: _located_on_both(pool, ns_id, keys), 5.0, "both holders filed")
        matched, num_home = pool.match_from_home(ns_id, keys)
        assert (matched.num_matched, num_home) == (128, 0)  # all of it elsewhere
        before = (_hits(n1.address), _hits(n2.address))
        assert _whole(pool, ns_id, keys)
        after = (_hits(n1.address), _hits(n2.address))
    assert after[0] > before[0] and after[1] > before[1]  # both served a share


def test_a_chain_the_home_node_holds_whole_is_read_from_it_with_no_lookup(
    store_factory, redis_single
):
    (_, n1, n2), keys, ns_id = _two_holders(store_factory, redis_single.url, 64)
    with PoolClient([n1.address], read_deadline_s=DEADLINE_S) as pool:
        pool.register_namespace(NS)
        wait_until(lambda: _located_on_both(pool, ns_id, keys), 5.0, "both holders filed")
        with Client(n1.address, transport="grpc") as c:
            locates, n2_hits = c.pool_status().num_locates, _hits(n2.address)
            for _ in range(3):
                assert _whole(pool, ns_id, keys)
            assert pool.match(ns_id, keys).num_matched == 64
            assert pool.match_from_home(ns_id, keys)[1] == 64
            assert c.pool_status().num_locates == locates
        assert _hits(n2.address) == n2_hits and pool.num_copies == 0


def test_a_killed_holder_costs_no_block_and_is_left_out(store_factory, redis_single):
    (n0, n1, _), keys, ns_id = _two_holders(store_factory, redis_single.url, 96)
    with PoolClient([n0.address], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        pool.register_namespace(NS)
        wait_until(lambda: _located_on_both(pool, ns_id, keys), 5.0, "both holders filed")
        n1.kill()  # still in the index until its TTL
        assert _whole(pool, ns_id, keys)
        assert pool.failing_nodes == [n1.address]
        assert _whole(pool, ns_id, keys)  # left out: no second dial


def test_a_frozen_holder_costs_at_most_one_read_deadline(store_factory, redis_single):
    (n0, n1, _), keys, ns_id = _two_holders(store_factory, redis_single.url, 96)
    with PoolClient([n0.address], read_deadline_s=DEADLINE_S, hot_reads=0) as pool:
        pool.register_namespace(NS)
        wait_until(lambda: _located_on_both(pool, ns_id, keys), 5.0, "both holders filed")
        n1.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert _whole(pool, ns_id, keys)
            assert time.monotonic() - started < 2 * DEADLINE_S + 1.0
            assert pool.failing_nodes == [n1.address]
        finally:
            n1.proc.send_signal(signal.SIGCONT)


def test_where_nothing_answers_every_call_is_misses(store_factory, redis_single):
    (_, n1, n2), keys, ns_id = _two_holders(store_factory, redis_single.url, 8)
    with PoolClient([n1.address, n2.address], read_deadline_s=DEADLINE_S) as pool:
        pool.register_namespace(NS)
        n1.kill()
        n2.kill()
        assert pool.locate(ns_id, keys).num_located == 0
        assert pool.match(ns_id, keys).num_matched == 0
        assert pool.get(ns_id, keys).num_found == 0
        buffers = [bytearray(NS.block_bytes) for _ in keys]
        assert pool.get_into(ns_id, keys, buffers) == (False,) * len(keys)


def test_a_hot_chain_gets_one_copy_on_the_readers_node(store_factory, redis_single, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.client")  # the copies' outcomes, on failure
    n1, n2 = (_serve(store_factory, redis_single.url, name) for name in ("n1", "n2"))
    keys = _chain(64)
    with Client(n1.address, transport="grpc") as c:
        ns_id = c.register_namespace(NS).namespace_id
        c.put_chain(ns_id, keys, [_payload(i) for i in range(64)])
        wait_until(lambda: len(c.pool_status().members) == 2, 10.0, "n1 sees n2")
    with PoolClient([n2.address], read_deadline_s=DEADLINE_S) as pool:
        pool.register_namespace(NS)
        wait_until(lambda: pool.locate(ns_id, keys).num_located == 64, 5.0, "n1's chain filed")
        assert _whole(pool, ns_id, keys)
        assert pool.num_copies == 0  # read once: not hot yet
        assert _whole(pool, ns_id, keys)  # hot: copied to n2, off the read path
        wait_until(lambda: _located_on_both(pool, ns_id, keys), 10.0, "the copy filed")
        wait_until(lambda: pool.num_copies == 1, 10.0, "the copier done")  # it counts last
        before = _hits(n2.address)
        assert _whole(pool, ns_id, keys)
        assert _hits(n2.address) > before  # the copy serves its share
        for _ in range(3):
            assert _whole(pool, ns_id, keys)
        assert pool.num_copies == 1  # the budget: two holders
