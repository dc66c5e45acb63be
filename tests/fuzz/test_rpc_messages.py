"""Well-typed, arbitrary messages to every RPC of one real store node (hypothesis), with and
without tokens (`rpc_cases`): every call ends OK or with a status that names the caller's
mistake or the node's limits, never UNKNOWN or INTERNAL; a Get sends only its own keys'
committed bytes; a Write stream into a real reservation applies its chunks in order until the
first bad one, leaves no block half written, and cannot touch another client's reservation.
Run last in its module, a check that nothing is left open once the timeouts have passed.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from tests.fuzz import rpc_cases as cases
from tests.fuzz.rpc_cases import (
    FUZZ,
    FUZZ_FEW,
    KNOWN_KEYS,
    MAX_MESSAGE_BYTES,
    MESSAGES,
    NS,
    REQUESTS,
    TIMEOUT_S,
    UNARY,
    Node,
    _check_allowed,
    _code,
    _content,
    _still_serving,
    u64,
)

node = cases.node  # a fixture: this module's node, without authentication and with tokens

# -- well-typed, arbitrary messages ------------------------------------------------------------


def _arbitrary_message_to_unary(node: Node, method: str, request) -> None:
    code, details = _code(lambda: getattr(node.stub, method)(request, timeout=10.0))
    _check_allowed(method, code, details)
    _still_serving(node)


def test_every_rpc_of_the_store_is_fuzzed():
    """An RPC added later must be listed in `REQUESTS`, or this fails."""
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    assert set(REQUESTS) == {method.name for method in service.methods}


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
