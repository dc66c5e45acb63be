"""The node's limits: namespace field sizes, namespaces, and open reservations and leases per
client and in all; each refusal is typed, names the limit, and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.client.common import raise_rpc_error
from kvstore.config import build
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import Store, StoreConfig
from kvstore.store.caller import Caller

NS = Namespace("limit-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
BLOCK = NS.block_bytes
A, B = Caller(owner="a"), Caller(owner="b")  # two clients


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _make_store(**kw) -> Store:
    config = StoreConfig(dram_bytes=64 * BLOCK, slab_bytes=4 * BLOCK, **kw)
    store = Store(config, clock=FakeClock())
    store.register_namespace(NS)
    return store


def _keys(seed: int, n: int = 1) -> list[bytes]:
    return block_keys(NS, [seed * 1000 + t for t in range(n * NS.block_tokens)])


def _namespace(model_id: str = "m", salt: bytes = b"", **layout: int) -> Namespace:
    fields = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4, **layout}
    return Namespace(model_id, KVLayout("float16", **fields), salt)


def test_namespaces_past_the_limit_are_refused():
    with _make_store(max_namespaces=3) as store:
        for i in range(2):
            store.register_namespace(_namespace(f"m{i}"))
        store.register_namespace(NS)  # again: not a new one
        with pytest.raises(errors.TooManyNamespacesError, match="max_namespaces = 3"):
            store.register_namespace(_namespace("one-too-many"))
        assert store.stats().num_namespaces == 3
        assert errors.TooManyNamespacesError.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(
    ("namespace", "what"),
    [
        (_namespace("m" * 257), "model_id has 257 bytes; the limit is 256"),
        (_namespace("é" * 129), "model_id has 258 bytes"),  # bytes, not characters
        (_namespace(salt=b"s" * 65), "tenant_salt has 65 bytes; the limit is 64"),
        (_namespace(num_layers=1025), "num_layers is 1025; the limit is 1024"),
        (_namespace(num_kv_heads=1025), "num_kv_heads is 1025"),
        (_namespace(head_dim=4097), "head_dim is 4097; the limit is 4096"),
        (_namespace(block_tokens=16385), "block_tokens is 16385; the limit is 16384"),
    ],
)
def test_namespace_fields_over_their_limits_are_refused(namespace, what):
    with _make_store() as store:
        with pytest.raises(errors.FieldTooLargeError, match=what):
            store.register_namespace(namespace)
        assert store.stats().num_namespaces == 1


def test_namespace_fields_at_their_limits_are_accepted():
    config = StoreConfig(dram_bytes=1 << 20, slab_bytes=1 << 20, max_head_dim=8)
    with Store(config) as store:
        store.register_namespace(_namespace("m" * 256, b"s" * 64, head_dim=8))
        with pytest.raises(errors.FieldTooLargeError, match=r"\(max_head_dim\)"):
            store.register_namespace(_namespace(head_dim=9))


def test_open_reservations_are_limited_per_client_and_in_all():
    with _make_store(max_reservations_per_client=2, max_reservations=3) as store:
        a1, a2 = (store.reserve(NS.id, _keys(i), caller=A) for i in range(2))
        with pytest.raises(errors.TooManyReservationsError, match="per_client = 2"):
            store.reserve(NS.id, _keys(2), caller=A)
        store.reserve(NS.id, _keys(3), caller=B)
        with pytest.raises(errors.TooManyReservationsError, match="max_reservations = 3"):
            store.reserve(NS.id, _keys(4), caller=B)
        assert store.stats().num_reservations == 3
        store.check_integrity()
        with pytest.raises(errors.UnknownReservationError):  # a's, to b: unknown
            store.reservation(a1.reservation_id, caller=B)
        store.reservation(a1.reservation_id, caller=A).abort()
        a2.write(0, 0, b"x" * BLOCK)
        a2.commit()
        for i in (5, 6):  # both of a's are ended: a may open two again
            store.reserve(NS.id, _keys(i), caller=A)
        store.clock.now += 30.0  # every reservation expires
        store.reserve(NS.id, _keys(7), caller=B)
        store.check_integrity()
        assert store.stats().num_reservations == 1


def test_open_leases_are_limited_per_client_and_in_all():
    with _make_store(max_leases_per_client=2, max_leases=3) as store:
        keys = _keys(0)
        first = store.acquire(NS.id, keys, caller=A)
        store.acquire(NS.id, keys, caller=A)
        with pytest.raises(errors.TooManyLeasesError, match="per_client = 2"):
            store.acquire(NS.id, keys, caller=A)
        store.acquire(NS.id, keys)  # in process: the local client
        with pytest.raises(errors.TooManyLeasesError, match="max_leases = 3"):
            store.acquire(NS.id, keys, caller=B)
        first.release()
        store.acquire(NS.id, keys, caller=A)
        store.clock.now += 30.0
        store.acquire(NS.id, keys, caller=B)  # the three before expired
        store.check_integrity()
        assert store.stats().num_leases == 1


def test_limits_come_from_flags_environment_and_file():
    env = {"KVSTORE_MAX_LEASES": "7", "KVSTORE_MAX_TENANT_SALT_BYTES": "16"}
    config = build(StoreConfig, env=env, file_values={"max_reservations_per_client": 5})
    assert (config.max_leases, config.max_tenant_salt_bytes) == (7, 16)
    assert config.max_reservations_per_client == 5
    with pytest.raises(errors.InvalidArgumentError, match="max_namespaces must be >= 1"):
        StoreConfig(max_namespaces=0)


# -- per gRPC peer, over a real server -------------------------------------------------------


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    store_config = StoreConfig(
        dram_bytes=64 << 20,
        slab_bytes=1 << 20,
        max_reservations_per_client=2,
        max_leases_per_client=2,
    )
    config = ServerConfig(port=0, dataplane="none", chunk_bytes=16 << 10)
    with EmbeddedServer(store_config, config) as s:
        with Client(s.address, transport="grpc") as client:
            client.register_namespace(BIG_NS)
        yield s


BIG_NS = Namespace("limit-big", KVLayout("float16", 8, 8, 64, 16))  # 256 KiB blocks


def _peer(server: EmbeddedServer) -> grpc.Channel:
    """A channel on a connection of its own: a peer of its own to the server."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
    return grpc.insecure_channel(server.address, options=options)


def _reserve(stub: pb_grpc.KVStoreStub, seed: int) -> pb.ReserveResponse:
    keys = block_keys(BIG_NS, [seed * 1000 + t for t in range(BIG_NS.block_tokens)])
    try:
        return stub.Reserve(pb.ReserveRequest(namespace_id=BIG_NS.id, keys=keys), timeout=10)
    except grpc.RpcError as err:
        raise_rpc_error(err)


def test_each_grpc_peer_has_its_own_reservations(server):
    with _peer(server) as one, _peer(server) as other:
        stub, other_stub = pb_grpc.KVStoreStub(one), pb_grpc.KVStoreStub(other)
        for seed in range(2):
            _reserve(stub, seed)
        with pytest.raises(errors.TooManyReservationsError, match="per_client = 2"):
            _reserve(stub, 2)
        assert _reserve(other_stub, 3).reservation_id
        assert server.store.stats().num_reservations == 3


def test_each_grpc_peer_has_its_own_leases(server):
    keys = block_keys(BIG_NS, list(range(BIG_NS.block_tokens)))
    with Client(server.address, transport="grpc") as client:
        client.put(BIG_NS.id, keys, [bytes(BIG_NS.block_bytes)])
    request = pb.GetRequest(namespace_id=BIG_NS.id, keys=keys)
    with _peer(server) as one, _peer(server) as other:
        stub = pb_grpc.KVStoreStub(one)
        streams = [stub.Get(request, timeout=30) for _ in range(2)]
        for stream in streams:  # read the header, then stall: the lease stays open
            assert next(stream).header.found == [True]
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Get(request, timeout=30))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leases_per_client = 2" in info.value.details()
        other_stream = pb_grpc.KVStoreStub(other).Get(request, timeout=30)
        assert sum(len(m.chunk.data) for m in other_stream) == BIG_NS.block_bytes
        for stream in streams:
            stream.cancel()
