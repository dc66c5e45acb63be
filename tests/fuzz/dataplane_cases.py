"""What the fuzz tests of the data plane's frames share (`test_dataplane_frames.py`,
`test_dataplane_adversary.py`): a namespace and its committed keys, the node's receive buffer
and transfer deadline, strategies of keys and nonzero bytes, decoding a frame received into a
zeroed buffer, the adversary (one connection of a raw UCX worker to the node, holding that
connection's secret), the node it fuzzes beside an honest client, and a key's bytes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Op, Reply, Request, RequestTags, Tags
from kvstore.keys import KEY_BYTES, KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer
from tests.conftest import wait_until

NS = Namespace("fuzz-dp", KVLayout("float16", 2, 2, 16, 16))  # 4 KiB blocks
MAX_BATCH_KEYS = 32
TRANSFER_TIMEOUT_S = 3.0  # an adversary's request that never completes ends by then (at
# 1 s, a right put on a two-core host running the whole suite ran past it in two CI runs)
KNOWN_KEYS = tuple(block_keys(NS, list(range(4 * NS.block_tokens))))  # committed at start
SERVER_BUF = frames.request_bytes(MAX_BATCH_KEYS)  # what the node receives a request into
PROPERTIES = settings(max_examples=300, deadline=None)
NODE_FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
keys32 = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)
parent_keys = keys32.map(lambda k: k if any(k) else b"\1" + k[1:])  # zeros mean "no parent"
# Bytes that are not all zero (a zeroed receive buffer holds zeros past a frame).
nonzero = st.builds(
    lambda head, byte, tail: head + bytes([byte]) + tail,
    st.binary(max_size=16),
    st.integers(1, 255),
    st.binary(max_size=16),
)


def _decode(data: bytes, room: int = 0) -> Request:
    """Decodes `data` received into a zeroed buffer `room` bytes longer than it."""
    return frames.decode_request(memoryview(bytearray(data) + bytes(room)))


@dataclass
class Adversary:
    """One connection of a raw UCX worker to the node, holding that connection's secret."""

    rt: Any
    node: Any  # an EmbeddedServer or a `kvstore serve` process: anything with an address
    tags: Tags = field(init=False)
    client_id: int = field(init=False)
    ep: Any = field(init=False)
    last_id: int = 1 << 40  # the highest request id it sent (its own requests count up)

    def __post_init__(self) -> None:
        request = pb.DataPlaneInfoRequest(transport="ucx", client_address=self.rt.worker_address)
        with grpc.insecure_channel(self.node.address) as channel:
            reply = pb_grpc.KVStoreStub(channel).DataPlaneInfo(request, timeout=30)
        self.tags, self.client_id = Tags(reply.connection_secret), reply.client_id
        self.ep = self.rt.call(self._connect(reply.server_address), 10.0)

    async def _connect(self, address: bytes) -> Any:
        ucx_address = self.rt.ucxx.get_ucx_address_from_buffer(address)
        return await self.rt.ctx.create_endpoint_from_worker_address(
            ucx_address, endpoint_error_handling=False
        )

    def send(self, data: bytes, tag: int) -> None:
        if tag == self.tags.request and len(data) <= SERVER_BUF:
            with contextlib.suppress(errors.InvalidArgumentError):
                self.last_id = max(self.last_id, _decode(data, SERVER_BUF - len(data)).request_id)
        buf = np.frombuffer(data or b"\0", np.uint8)[: len(data)]
        self.rt.call(self.ep.send(buf, tag=tag, force_tag=True), 10.0)

    def next_id(self) -> int:
        """An id past every one it sent, as a client's are: the node expects its blocks."""
        self.last_id = min(self.last_id + 1, frames.MAX_REQUEST_ID)
        return self.last_id

    def receive_reply(
        self, tag: int, num_keys: int, timeout_s: float, give_up: Callable[[], bool] = bool
    ) -> Reply | None:
        """The reply the node sends under `tag`; None if none came within `timeout_s` or
        `give_up()` said so first (then this connection must not be used again: the
        receive may still be posted)."""
        buf = bytearray(frames.reply_bytes(num_keys))
        received = self.rt.submit(self.ep.recv(buf, tag=tag, force_tag=True))
        deadline = time.monotonic() + timeout_s
        while not received.done():
            if time.monotonic() > deadline or give_up():
                received.cancel()
                return None
            time.sleep(0.02)
        received.result()
        return frames.decode_reply(memoryview(buf), num_keys)

    def answers(self) -> bool:
        """Whether the node still serves this connection: a GET of an unknown namespace,
        sent after everything before it, gets its (error) reply."""
        request_id = self.next_id()
        probe = Request(Op.GET, request_id, bytes(KEY_BYTES), (bytes(KEY_BYTES),), 1)
        self.send(frames.encode_request(probe), self.tags.request)
        reply_tag = RequestTags.of(self.tags, request_id).reply
        reply = self.receive_reply(reply_tag, 1, TRANSFER_TIMEOUT_S + 5.0)
        return reply is not None and isinstance(reply.error, errors.UnknownNamespaceError)

    def close(self) -> None:
        self.rt.loop.call_soon_threadsafe(lambda: self.ep.abort(period=10**8))


@dataclass
class Node:
    server: EmbeddedServer
    client: Client  # the honest client: one connection for the whole module
    client_id: int
    rt: Any  # the adversary's worker
    adversary: Adversary | None = None
    num_round_trips: int = 0

    def connected(self, client_id: int) -> bool:
        """Whether the node still holds connection `client_id`, once its loop has run the
        drops already scheduled."""
        dp = self.server.dataplanes["ucx"]
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), dp._rt.loop).result(timeout=10)
        return client_id in dp._connections

    def retire_adversary(self) -> None:
        """Ends the adversary's connection as a client does (CLOSE), so that the node does
        not hold it until its idle deadline; the next example makes a fresh one."""
        adv, self.adversary = self.adversary, None
        if adv is not None and self.connected(adv.client_id):
            close = Request(Op.CLOSE, 0, bytes(KEY_BYTES), (), 0)
            adv.send(frames.encode_request(close), adv.tags.request)
            wait_until(lambda: not self.connected(adv.client_id), 10.0, "the connection ends")
        if adv is not None:
            adv.close()


def _content(key: bytes, nbytes: int = NS.block_bytes) -> bytes:
    seed = hashlib.blake2b(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]
