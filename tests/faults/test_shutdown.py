"""SIGTERM and SIGINT to a real store with calls in flight: they finish within --grace-s,
new connections are refused meanwhile, and the process exits 0.

The call in flight is a Get stream past gRPC's flow-control window, read up to its header:
the server is inside the handler, holding a lease, until the reader goes on.
"""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import StoreProcess, open_get_stream, wait_until

NS = Namespace("shutdown-model", KVLayout("float16", 8, 8, 128, 16))  # 512 KiB blocks
BLOCK = NS.block_bytes
KEYS = block_keys(NS, np.arange(24 * NS.block_tokens))  # 12 MiB


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


def _start_with_call_in_flight(store_factory, grace_s: float):
    store = store_factory(
        "--dram-bytes", str(48 * BLOCK), "--slab-bytes", str(8 * BLOCK),
        "--grace-s", str(grace_s), "--dataplane", "none",
    )  # fmt: skip
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, KEYS, [_payload(k) for k in KEYS])
        stream, assembler = open_get_stream(store.address, NS.id, KEYS)
        assert client.stats().num_leases == 1  # the handler is under way
    return store, stream, assembler


def _signal_and_wait_for_drain(store: StoreProcess, sig: signal.Signals) -> float:
    store.proc.send_signal(sig)
    start = time.monotonic()
    wait_until(lambda: "event=draining" in store.log(), 30.0, "the store began to drain")
    with pytest.raises(errors.UnavailableError):  # a new connection is refused
        Client(store.address, timeout_s=5.0).stats()
    return start


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_calls_in_flight_finish_and_the_process_exits_0(store_factory, sig):
    grace_s = 20.0
    store, stream, assembler = _start_with_call_in_flight(store_factory, grace_s)
    start = _signal_and_wait_for_drain(store, sig)
    for msg in stream:  # the reader goes on: the call completes
        assembler.feed(msg)
    got = assembler.result().blocks
    assert [bytes(b) for b in got if b is not None] == [_payload(k).tobytes() for k in KEYS]
    assert store.proc.wait(timeout=grace_s + 30.0) == 0
    assert time.monotonic() - start < grace_s, "waited out the grace after the call ended"
    log = store.log()
    assert "event=stopped" in log and "Traceback" not in log


def test_a_call_past_the_grace_is_cancelled_and_the_process_exits_0(store_factory):
    grace_s = 1.0
    store, stream, assembler = _start_with_call_in_flight(store_factory, grace_s)
    start = _signal_and_wait_for_drain(store, signal.SIGTERM)
    assert store.proc.wait(timeout=grace_s + 30.0) == 0  # nobody reads: the grace runs out
    assert time.monotonic() - start >= grace_s
    with pytest.raises(grpc.RpcError) as cut:
        for msg in stream:
            assembler.feed(msg)
    assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert "event=stopped" in store.log()
