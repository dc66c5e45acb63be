"""What the fuzz tests of one real store node's RPCs share (`test_rpc_bytes.py`,
`test_rpc_messages.py`): a module's `node`, without authentication and with tokens (then every
call of the fuzzing carries a tenant's token), on a fake clock, holding some committed blocks;
the statuses a call may end with besides OK; the check after every example that a fresh
block's put and get work, `check_integrity` passes and, once the clock has moved past the
timeouts, no reservation or lease of the fuzzing clients is left; and a strategy of
well-typed, arbitrary messages for every RPC."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth.channels import open_channel
from kvstore.auth.listener import ListenerSecurity
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import StoreConfig

NS = Namespace("fuzz-model", KVLayout("float16", 2, 2, 16, 16))  # 4 KiB blocks
OTHER = Namespace("fuzz-other", KVLayout("bfloat16", 1, 1, 8, 4))  # 64-byte blocks
MAX_BATCH_KEYS = 16
TIMEOUT_S = 10.0  # reservations and leases, on the node's fake clock
MAX_MESSAGE_BYTES = 1 << 20
KNOWN_KEYS = tuple(block_keys(NS, list(range(8 * NS.block_tokens))))  # committed at start
SERVICE = "/kvstore.v1.KVStore/"
TOKEN = "fuzz-token-0123456789abcdef"
OTHER_TOKEN = "bystander-token-0123456789"
# A caller's mistake or a limit of the node: what any request may end with besides OK.
ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
REQUESTS = {
    "RegisterNamespace": pb.RegisterNamespaceRequest,
    "Match": pb.MatchRequest,
    "Reserve": pb.ReserveRequest,
    "Commit": pb.CommitRequest,
    "Abort": pb.AbortRequest,
    "Remove": pb.RemoveRequest,
    "Stats": pb.StatsRequest,
    "DataPlaneInfo": pb.DataPlaneInfoRequest,
    "Locate": pb.LocateRequest,
    "PoolStatus": pb.PoolStatusRequest,
    "Get": pb.GetRequest,
    "Write": pb.WriteChunk,
}
# DataPlaneInfo checks each address in a separate process: fewer examples of it.
UNARY = tuple(m for m in REQUESTS if m not in ("Get", "Write", "DataPlaneInfo"))
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FUZZ_FEW = settings(FUZZ, max_examples=25)


def _content(key: bytes, nbytes: int = NS.block_bytes) -> bytes:
    seed = hashlib.blake2b(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    server: EmbeddedServer
    clock: FakeClock
    channel: grpc.Channel
    stub: pb_grpc.KVStoreStub
    client: Client  # a well-behaved client beside the fuzzing channel
    other: Client  # another owner of reservations: another peer, or with tokens another tenant
    has_tokens: bool  # every call needs a token (the channel and the clients carry one)
    fresh: Iterator[int] = field(default_factory=itertools.count)

    def fresh_keys(self, n: int) -> list[bytes]:
        return [
            hashlib.blake2b(b"fresh%d" % next(self.fresh), digest_size=32).digest()
            for _ in range(n)
        ]


@pytest.fixture(scope="module", params=["open", "tokens"])
def node(request, tmp_path_factory) -> Iterator[Node]:
    """A node without authentication, and one with tokens: there every call of the fuzzing
    carries a tenant's token, so the bytes reach the handlers as that tenant's."""
    store_config = StoreConfig(
        dram_bytes=32 << 20,
        slab_bytes=1 << 20,
        max_batch_keys=MAX_BATCH_KEYS,
        reservation_timeout_s=TIMEOUT_S,
        lease_timeout_s=TIMEOUT_S,
    )
    token = TOKEN if request.param == "tokens" else ""
    tokens = tmp_path_factory.mktemp("fuzz-tokens") / "tokens"
    tokens.write_text(f"fuzzers {TOKEN}\nbystanders {OTHER_TOKEN}\n")
    config = ServerConfig(
        port=0,
        max_message_bytes=MAX_MESSAGE_BYTES,
        chunk_bytes=1500,
        security=ListenerSecurity(auth_token_file=str(tokens) if token else ""),
    )
    server = EmbeddedServer(store_config, config)
    clock = FakeClock()
    server.store.clock = clock  # before it serves: deadlines move only with the test
    with server:
        channel = open_channel(server.address, auth_token=token)
        other_token = OTHER_TOKEN if token else ""
        with (
            Client(server.address, timeout_s=10.0, transport="grpc", auth_token=token) as client,
            Client(
                server.address, timeout_s=10.0, transport="grpc", auth_token=other_token
            ) as other,
        ):
            client.register_namespace(NS)
            client.register_namespace(OTHER)
            client.put_chain(NS.id, list(KNOWN_KEYS), [_content(k) for k in KNOWN_KEYS])
            other.register_namespace(NS)
            stub = pb_grpc.KVStoreStub(channel)
            yield Node(server, clock, channel, stub, client, other, bool(token))
        channel.close()


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _check_allowed(method: str, code: grpc.StatusCode, details: str) -> None:
    event(f"{method}: {code.name}")
    assert code in ALLOWED, f"{method} answered {code.name}: {details}"


def _still_serving(node: Node) -> None:
    """A fresh block round-trips; after the timeouts nothing is left open; the index holds."""
    [key] = node.fresh_keys(1)
    block = _content(key)
    assert node.client.put(NS.id, [key], [block]).num_stored == 1
    assert bytes(node.client.get(NS.id, [key]).blocks[0]) == block
    node.client.remove(NS.id, [key])
    node.clock.now += TIMEOUT_S + 1  # whoever holds a reservation or lease is gone
    node.server.store.expire()
    stats = node.client.stats()
    assert (stats.num_reservations, stats.num_leases) == (0, 0)
    node.server.store.check_integrity()


# -- strategies ------------------------------------------------------------------------------

u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1), st.just(2**32 - 1))
layout_numbers = st.one_of(st.integers(0, 16), st.integers(1, 16), u32)
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1), st.just(2**64 - 1))
any_key = st.one_of(
    st.sampled_from(KNOWN_KEYS), st.binary(min_size=32, max_size=32), st.binary(max_size=40)
)
key_lists = st.one_of(
    st.lists(any_key, max_size=MAX_BATCH_KEYS + 2),
    st.lists(st.sampled_from(KNOWN_KEYS), min_size=1, max_size=8, unique=True),
)
ns_ids = st.one_of(st.sampled_from([NS.id, OTHER.id]), st.binary(max_size=40))
texts = st.one_of(st.text(max_size=40), st.text(max_size=300), st.just("llama\nx"))
namespaces = st.builds(
    pb.Namespace,
    model_id=texts,
    dtype=st.one_of(st.sampled_from(["float16", "bfloat16", "int8", "float13"]), texts),
    num_layers=layout_numbers,
    num_kv_heads=layout_numbers,
    head_dim=layout_numbers,
    block_tokens=layout_numbers,
    tenant_salt=st.binary(max_size=100),
)
parent_lists = st.lists(st.one_of(st.just(b""), any_key), max_size=MAX_BATCH_KEYS + 2)
MESSAGES = {
    "RegisterNamespace": st.builds(pb.RegisterNamespaceRequest, namespace=namespaces),
    "Match": st.builds(pb.MatchRequest, namespace_id=ns_ids, keys=key_lists),
    "Reserve": st.builds(
        pb.ReserveRequest,
        namespace_id=ns_ids,
        keys=key_lists,
        parent_keys=parent_lists,
        chain_depth=u32,
        chain_group=st.one_of(st.just(b""), any_key),
    ),
    "Commit": st.builds(pb.CommitRequest, reservation_id=u64),
    "Abort": st.builds(pb.AbortRequest, reservation_id=u64),
    "Remove": st.builds(pb.RemoveRequest, namespace_id=ns_ids, keys=key_lists),
    "Stats": st.builds(pb.StatsRequest),
    "DataPlaneInfo": st.builds(
        pb.DataPlaneInfoRequest,
        transport=st.one_of(st.just("ucx"), texts),
        client_address=st.binary(max_size=600),
    ),
    "Locate": st.builds(
        pb.LocateRequest,
        namespace_id=ns_ids,
        keys=key_lists,
        chain_depth=u32,
        chain_group=st.one_of(st.just(b""), any_key),
    ),
    "PoolStatus": st.builds(pb.PoolStatusRequest, sample_blocks=u32),
    "Get": st.builds(pb.GetRequest, namespace_id=ns_ids, keys=key_lists),
    "Write": st.builds(
        pb.WriteChunk, reservation_id=u64, index=u32, offset=u64, data=st.binary(max_size=64)
    ),
}
