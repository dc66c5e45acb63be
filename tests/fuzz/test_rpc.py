"""Arbitrary bytes and arbitrary messages to every RPC of one real store node (hypothesis).

Every call ends OK or with a status that names the caller's mistake or the node's limits,
never UNKNOWN or INTERNAL (an exception that escaped a handler). After every example the
node serves a fresh block's put and get, `check_integrity` passes, and once the clock has
moved past the timeouts no reservation or lease of the fuzzing clients is left. A request
that does not parse is INVALID_ARGUMENT with one log line, on the health service too.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth.channels import open_channel
from kvstore.auth.listener import ListenerSecurity
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import StoreConfig
from tests.conftest import wait_until

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


def _parses(method: str, data: bytes) -> bool:
    try:
        REQUESTS[method].FromString(data)
    except DecodeError:
        return False
    return True


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.INFO]


def _one_log_line(caplog: pytest.LogCaptureFixture, method: str) -> None:
    """A malformed request is logged once: not zero times, not a traceback per layer."""
    lines = wait_until(lambda: _log_lines(caplog), 5.0, f"{method}: a log line")
    assert len(lines) == 1, [f"{r.name}: {r.getMessage()}" for r in lines]


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
        pb.ReserveRequest, namespace_id=ns_ids, keys=key_lists, parent_keys=parent_lists
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
    "Get": st.builds(pb.GetRequest, namespace_id=ns_ids, keys=key_lists),
    "Write": st.builds(
        pb.WriteChunk, reservation_id=u64, index=u32, offset=u64, data=st.binary(max_size=64)
    ),
}


@st.composite
def raw_requests(draw: st.DrawFn, method: str) -> bytes:
    """Random bytes, or a well-formed request cut short, extended or with a bit flipped."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(draw(MESSAGES[method]).SerializeToString())
    damage = draw(st.sampled_from(["cut", "extend", "flip"]))
    if damage == "cut":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if damage == "extend" or not data:
        return bytes(data) + draw(st.binary(min_size=1, max_size=20))
    bit = draw(st.integers(0, 8 * len(data) - 1))
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


# -- raw bytes -------------------------------------------------------------------------------


def _raw_unary(node: Node, method: str) -> Callable[[bytes], bytes]:
    return node.channel.unary_unary(SERVICE + method, None, None)


def _raw_bytes_to_unary(node: Node, caplog, method: str, payload: bytes) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO)
    code, details = _code(lambda: _raw_unary(node, method)(payload, timeout=10.0))
    _check_allowed(method, code, details)
    if not _parses(method, payload):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {code.name}: {details}"
        _one_log_line(caplog, method)
    _still_serving(node)


@pytest.mark.parametrize("method", UNARY)
@FUZZ
@given(data=st.data())
def test_raw_bytes_to_unary_rpcs(node, caplog, method, data):
    _raw_bytes_to_unary(node, caplog, method, data.draw(raw_requests(method)))


@pytest.mark.parametrize("method", [*UNARY, "DataPlaneInfo"])
@FUZZ_FEW
@given(payload=st.binary(max_size=256))
def test_raw_bytes_without_a_token_are_unauthenticated(node, caplog, method, payload):
    """With tokens, a call without one is refused before any handler reads its bytes;
    without, no call is refused for lacking one."""
    with grpc.insecure_channel(node.server.address) as bare:
        code, details = _code(lambda: bare.unary_unary(SERVICE + method)(payload, timeout=10.0))
    if node.has_tokens:
        assert code is grpc.StatusCode.UNAUTHENTICATED
    else:
        _check_allowed(method, code, details)
    _still_serving(node)


@FUZZ_FEW
@given(payload=raw_requests("DataPlaneInfo"))
def test_raw_bytes_to_data_plane_info(node, caplog, payload):
    _raw_bytes_to_unary(node, caplog, "DataPlaneInfo", payload)


@FUZZ
@given(payload=st.binary(max_size=64))
def test_raw_bytes_to_health_check(node, caplog, payload):
    """The standard health service is behind the same decoding as the store's RPCs."""
    caplog.clear()
    caplog.set_level(logging.INFO)
    check = node.channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
    code, details = _code(lambda: check(payload, timeout=10.0))
    try:
        service = health_pb2.HealthCheckRequest.FromString(payload).service
    except DecodeError:
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Check: {code.name}: {details}"
        _one_log_line(caplog, "Check")
    else:
        known = service in ("", "kvstore.v1.KVStore")
        assert code is (grpc.StatusCode.OK if known else grpc.StatusCode.NOT_FOUND), details
    _still_serving(node)


@FUZZ
@given(payload=raw_requests("Get"))
def test_raw_bytes_to_get(node, caplog, payload):
    caplog.clear()
    caplog.set_level(logging.INFO)
    get = node.channel.unary_stream(SERVICE + "Get", None, None)
    code, details = _code(lambda: list(get(payload, timeout=10.0)))
    _check_allowed("Get", code, details)
    if not _parses("Get", payload):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Get: {code.name}: {details}"
        _one_log_line(caplog, "Get")
    _still_serving(node)


@FUZZ
@given(chunks=st.lists(raw_requests("Write"), min_size=1, max_size=3))
def test_raw_bytes_to_write(node, caplog, chunks):
    """A stream whose first chunk does not parse is INVALID_ARGUMENT; any other ends as
    its first bad chunk says (after it, nothing more of the stream is read)."""
    caplog.clear()
    caplog.set_level(logging.INFO)
    write = node.channel.stream_unary(SERVICE + "Write", None, None)
    code, details = _code(lambda: write(iter(chunks), timeout=10.0))
    _check_allowed("Write", code, details)
    if not _parses("Write", chunks[0]):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Write: {code.name}: {details}"
        _one_log_line(caplog, "Write")
    _still_serving(node)


# -- well-typed, arbitrary messages ------------------------------------------------------------


def _arbitrary_message_to_unary(node: Node, method: str, request) -> None:
    code, details = _code(lambda: getattr(node.stub, method)(request, timeout=10.0))
    _check_allowed(method, code, details)
    _still_serving(node)


@pytest.mark.parametrize("method", UNARY)
@FUZZ
@given(data=st.data())
def test_arbitrary_messages_to_unary_rpcs(node, method, data):
    _arbitrary_message_to_unary(node, method, data.draw(MESSAGES[method]))


@FUZZ_FEW
@given(request=MESSAGES["DataPlaneInfo"])
def test_arbitrary_messages_to_data_plane_info(node, request):
    _arbitrary_message_to_unary(node, "DataPlaneInfo", request)


@FUZZ
@given(request=MESSAGES["Get"])
def test_arbitrary_get_sends_only_its_keys_blocks(node, request):
    """A Get answers with a header for every key and then only the blocks it found, each
    the committed bytes of its own key."""
    responses: list[pb.GetResponse] = []
    code, details = _code(lambda: responses.extend(node.stub.Get(request, timeout=10.0)))
    _check_allowed("Get", code, details)
    if code is grpc.StatusCode.OK:
        header, chunks = responses[0].header, [r.chunk for r in responses[1:]]
        assert len(header.found) == len(request.keys)
        blocks = {i: bytearray() for i, found in enumerate(header.found) if found}
        for chunk in chunks:
            assert len(blocks[chunk.index]) == chunk.offset, "chunks out of order"
            blocks[chunk.index] += chunk.data
        for i, block in blocks.items():
            key = request.keys[i]
            assert request.namespace_id == NS.id and key in KNOWN_KEYS, "found a block never put"
            assert bytes(block) == _content(key), "another key's bytes"
    _still_serving(node)


chunk_specs = st.lists(
    st.tuples(
        st.sampled_from(["real"] * 6 + ["other"]),  # the reservation it names
        st.sampled_from([0, 1] * 3 + [2, 2**32 - 1]),  # block index
        st.sampled_from(["next"] * 6 + [0, 1, 2**64 - 1]),  # offset
        st.one_of(  # size: the rest of the block, part of it, too much, over gRPC's limit
            st.sampled_from(["rest"] * 4 + ["half", "oversize"]),
            st.integers(0, NS.block_bytes + 1),
        ),
    ),
    max_size=8,
)


@FUZZ
@given(
    num_good=st.integers(0, 2),
    specs=chunk_specs,
    rid_other=st.just("foreign") | u64,
    commit=st.booleans(),
)
def test_arbitrary_write_stream_into_a_real_reservation(node, num_good, specs, rid_other, commit):
    """Chunks into a fresh reservation of two blocks, at right and wrong offsets, sizes and
    indices, or naming another reservation (an unknown id, or another owner's), after
    `num_good` blocks sent right (in two halves). The stream applies chunks in order until
    the first bad one and leaves no block half written; a commit succeeds exactly when both
    blocks are whole, and then a Get returns exactly what the chunks wrote. The other
    client's reservation stays its own: this one can neither write, commit nor abort it."""
    good = [("real", i, "next", size) for i in range(num_good) for size in ("half", "rest")]
    keys = node.fresh_keys(2)
    # Reserved on the fuzzing channel: a reservation is its owner's (one client) alone.
    rid = node.stub.Reserve(pb.ReserveRequest(namespace_id=NS.id, keys=keys)).reservation_id
    foreign = node.other.reserve(NS.id, node.fresh_keys(1)).reservation_id
    rid_other = foreign if rid_other == "foreign" else rid_other
    written = [bytearray(), bytearray()]
    chunks, expected = [], grpc.StatusCode.OK
    for target, index, offset, size in good + specs:
        chunk_rid = rid if target == "real" else rid_other
        if offset == "next":
            offset = len(written[index]) if index < 2 else 0
        rest = NS.block_bytes - len(written[index]) if index < 2 else NS.block_bytes
        size = {"rest": rest, "half": rest // 2, "oversize": MAX_MESSAGE_BYTES + 1}.get(size, size)
        data = _content(b"%d" % len(chunks), size)
        chunks.append(
            pb.WriteChunk(reservation_id=chunk_rid, index=index, offset=offset, data=data)
        )
        if expected is grpc.StatusCode.OK:
            expected = _apply(written, rid, chunk_rid, index, offset, data)
    for block in written:  # all or nothing per block
        if len(block) != NS.block_bytes:
            block.clear()
    code, details = _code(lambda: node.stub.Write(iter(chunks), timeout=10.0))
    _check_allowed("Write", code, details)
    assert code is expected, f"Write: {code.name} ({details}), expected {expected.name}"
    whole = all(len(b) == NS.block_bytes for b in written)
    if commit:
        request = pb.CommitRequest(reservation_id=rid)
        code, details = _code(lambda: node.stub.Commit(request, timeout=10.0))
        assert code is (grpc.StatusCode.OK if whole else grpc.StatusCode.INVALID_ARGUMENT), details
        event(f"commit: {code.name}")
    got = node.client.get(NS.id, keys).blocks
    if commit and whole:
        assert [bytes(b) for b in got] == [bytes(b) for b in written]
    else:
        assert got == (None, None)
    for call, request_cls in (
        (node.stub.Commit, pb.CommitRequest),
        (node.stub.Abort, pb.AbortRequest),
    ):
        request = request_cls(reservation_id=foreign)
        code, _ = _code(lambda c=call, r=request: c(r, timeout=10.0))
        assert code is grpc.StatusCode.NOT_FOUND, "another client's reservation"
    node.other.abort(foreign)  # still open, and its owner's
    _still_serving(node)


def _apply(
    written: list[bytearray], rid: int, chunk_rid: int, index: int, offset: int, data: bytes
) -> grpc.StatusCode:
    """What the node does with one chunk: the status it ends the stream with, or OK."""
    if len(data) > MAX_MESSAGE_BYTES:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if chunk_rid != rid:
        return grpc.StatusCode.NOT_FOUND
    if index >= 2 or offset != len(written[index]):
        return grpc.StatusCode.INVALID_ARGUMENT
    if offset + len(data) > NS.block_bytes:
        return grpc.StatusCode.INVALID_ARGUMENT
    written[index] += data
    return grpc.StatusCode.OK


def test_after_the_fuzzing_nothing_is_left_open(node):
    """Run last in this module: the node still holds its first blocks, its index is
    consistent, and once every holder is gone and the timeouts passed nothing is open."""
    node.clock.now += TIMEOUT_S + 1
    node.server.store.expire()
    stats = node.client.stats()
    assert (stats.num_reservations, stats.num_leases) == (0, 0)
    node.server.store.check_integrity()
    _still_serving(node)
