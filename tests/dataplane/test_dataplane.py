"""The UCX data plane against real `kvstore serve` processes: same bytes as the gRPC path,
zero-copy into numpy/torch buffers, typed errors, nothing committed from a bad payload."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.client import Client
from kvstore.dataplane import ChecksumMismatchError
from kvstore.dataplane.buffers import TransferBuffer
from kvstore.dataplane.frames import Op, Request
from kvstore.dataplane.ucx import client as ucx_client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import require_extra, wait_no_leases

require_extra("ucxx")

NS = Namespace("llama-dp", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]


def _client(store, transport: str) -> Client:
    client = Client(store.address, timeout_s=10.0, transport=transport)
    client.register_namespace(NS)
    return client


@pytest.fixture
def ucx(store):
    with _client(store, "ucx") as client:
        yield client


@pytest.fixture
def grpc_client(store):
    with _client(store, "grpc") as client:
        yield client


@pytest.mark.parametrize(("writer", "reader"), [("ucx", "grpc"), ("grpc", "ucx"), ("ucx", "ucx")])
def test_both_paths_move_identical_bytes(ucx, grpc_client, writer, reader):
    clients = {"ucx": ucx, "grpc": grpc_client}
    keys, blocks = _chain(8, seed=1), _blocks(8, seed=1)
    assert clients[writer].put_chain(NS.id, keys, blocks).num_stored == 8
    out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
    assert clients[reader].get_into(NS.id, keys, out) == (True,) * 8
    got_grpc = grpc_client.get(NS.id, keys).blocks
    for block, mine, theirs in zip(blocks, out, got_grpc, strict=True):
        assert bytes(block) == bytes(mine) == bytes(theirs)  # type: ignore[arg-type]
    assert ucx.data_plane() is not None and grpc_client.data_plane() is None
    wait_no_leases(ucx)


def test_miss_leaves_buffer_untouched_and_hits_land_in_place(ucx):
    keys, blocks = _chain(3, seed=2), _blocks(3, seed=2)
    ucx.put_chain(NS.id, keys[:2], blocks[:2])
    out = [np.full(NS.block_bytes, 7, np.uint8) for _ in keys]
    pointers = [a.ctypes.data for a in out]
    assert ucx.get_into(NS.id, keys, out) == (True, True, False)
    assert [a.ctypes.data for a in out] == pointers
    assert bytes(out[0]) == bytes(blocks[0]) and bytes(out[1]) == bytes(blocks[1])
    assert (out[2] == 7).all()


def test_typed_buffers_bytearray_and_shaped_arrays(ucx):
    keys, blocks = _chain(2, seed=3), _blocks(2, seed=3)
    ucx.put(NS.id, keys, [blocks[0].view(np.float16).reshape(64, -1), bytearray(blocks[1])])
    out = [bytearray(NS.block_bytes), np.zeros((16, NS.block_bytes // 32), np.float16)]
    assert ucx.get_into(NS.id, keys, out) == (True, True)
    assert bytes(out[0]) == bytes(blocks[0]) and out[1].tobytes() == bytes(blocks[1])


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_torch_tensors_cpu(ucx, grpc_client, transport):
    torch = require_extra("torch")
    client = {"ucx": ucx, "grpc": grpc_client}[transport]
    keys = _chain(2, seed=4)
    src = [torch.randn(NS.block_bytes // 2).to(torch.bfloat16) for _ in keys]
    client.put(NS.id, keys, src)
    out = [torch.empty(NS.block_bytes // 2, dtype=torch.bfloat16) for _ in keys]
    assert client.get_into(NS.id, keys, out) == (True, True)
    assert all(torch.equal(a, b) for a, b in zip(src, out, strict=True))


def test_wrong_buffer_size_is_rejected_and_store_keeps_serving(ucx):
    keys = _chain(2, seed=5)
    with pytest.raises(errors.PayloadSizeError):
        ucx.get_into(NS.id, keys, [np.zeros(NS.block_bytes + 1, np.uint8)] * 2)
    with pytest.raises(errors.PayloadSizeError):
        ucx.put(NS.id, keys, [np.zeros(NS.block_bytes + 8, np.uint8)] * 2)
    with pytest.raises(errors.InvalidArgumentError):
        ucx.get_into(NS.id, keys, [np.zeros(NS.block_bytes, np.uint8)[::2]] * 2)
    assert ucx.put_chain(NS.id, keys, _blocks(2)).num_stored == 2
    wait_no_leases(ucx)


def test_wrong_checksum_is_never_committed(ucx, monkeypatch):
    keys = _chain(4, seed=6)
    monkeypatch.setattr(ucx_client, "_checksums", lambda bufs: (12345,) * len(bufs))
    with pytest.raises(ChecksumMismatchError, match="nothing committed"):
        ucx.put_chain(NS.id, keys, _blocks(4, seed=6))
    assert ucx.match(NS.id, keys).num_matched == 0
    wait_no_leases(ucx)


def test_short_payload_is_never_committed(ucx):
    """A sender that declares full blocks but sends fewer bytes: the checksum catches it."""
    keys, blocks = _chain(2, seed=7), _blocks(2, seed=7)
    dataplane = ucx.data_plane()
    assert isinstance(dataplane, ucx_client.UcxClient)
    checksums = tuple(checksum(b) for b in blocks)
    req = Request(Op.PUT, 10_000, NS.id, tuple(keys), NS.block_bytes, None, checksums)
    short = [TransferBuffer(memoryview(b)[:-100], NS.block_bytes - 100, False) for b in blocks]
    with pytest.raises(ChecksumMismatchError):
        dataplane._submit(dataplane._put(req, short)).result()
    assert ucx.match(NS.id, keys).num_matched == 0
    wait_no_leases(ucx)


def test_pipelined_batches_all_complete(ucx):
    keys, blocks = _chain(32, seed=8), _blocks(32, seed=8)
    ucx.put_chain(NS.id, keys, blocks)
    dataplane = ucx.data_plane()
    assert isinstance(dataplane, ucx_client.UcxClient)
    outs = [[np.zeros(NS.block_bytes, np.uint8) for _ in keys] for _ in range(6)]
    big = [dataplane.submit_get_into(NS.id, keys, out, NS.block_bytes) for out in outs[:5]]
    small_out = outs[5][:1]
    small = dataplane.submit_get_into(NS.id, keys[:1], small_out, NS.block_bytes)
    assert small.result(timeout=10) == (True,)
    assert all(f.result(timeout=10) == (True,) * 32 for f in big)
    assert all(bytes(o[i]) == bytes(blocks[i]) for o in outs[:5] for i in range(32))
    wait_no_leases(ucx)


def test_get_in_parts_lands_each_part_in_its_own_buffer_part_by_part(ucx):
    """A block of 4 layers, received as 4 parts into 4 separate arrays (as a paged cache
    holds layers apart): the same bytes; `on_part(s)` comes in order, once part s of every
    found block is in place; a missed key's parts are untouched."""
    keys, blocks = _chain(4, seed=11), _blocks(4, seed=11)
    ucx.put_chain(NS.id, keys[:3], blocks[:3])
    num_parts, size = 4, NS.block_bytes // 4
    layers = [np.full((len(keys), size), 7, np.uint8) for _ in range(num_parts)]
    seen: list[tuple[int, bool]] = []

    def on_part(s: int) -> None:
        landed = all((layers[s][i] == blocks[i][s * size : (s + 1) * size]).all() for i in range(3))
        seen.append((s, landed))

    dataplane = ucx.data_plane()
    assert isinstance(dataplane, ucx_client.UcxClient)
    parts = [list(layer) for layer in layers]  # parts[s][i]: a view into layer s's array
    found = dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes, on_part)
    assert found.result(timeout=10) == (True, True, True, False)
    assert seen == [(s, True) for s in range(num_parts)]
    for i in range(3):
        assert np.concatenate([layer[i] for layer in layers]).tobytes() == bytes(blocks[i])
    assert all((layer[3] == 7).all() for layer in layers)
    wait_no_leases(ucx)


def test_a_batch_larger_than_ucxx_futures_pool_posts_without_refill_warnings(ucx, capfd):
    """ucxx hands each request a future from a pool of 100 and warns (from C++, on stderr)
    whenever a post finds it empty; a batch tops it up as it posts (`transfers._post`)."""
    keys, blocks = _chain(40, seed=13), _blocks(40, seed=13)
    ucx.put_chain(NS.id, keys, blocks)
    parts = [[np.zeros(NS.block_bytes // 8, np.uint8) for _ in keys] for _ in range(8)]
    found = ucx.data_plane().submit_get_parts(NS.id, keys, parts, NS.block_bytes)
    assert found.result(timeout=10) == (True,) * 40  # 320 receives, posted in one pass
    out = capfd.readouterr()
    assert "No Futures available" not in out.err + out.out  # UCX logs to stdout


@pytest.mark.parametrize("num_parts", [0, 3, 1 << 14])
def test_get_in_parts_that_do_not_fit_is_refused(ucx, num_parts):
    """Parts must divide the block and be told apart by their tags (keys x parts <= 2^16)."""
    keys = _chain(8, seed=12)
    size = NS.block_bytes // max(num_parts, 1)
    parts = [[np.zeros(size, np.uint8) for _ in keys] for _ in range(num_parts)]
    with pytest.raises(errors.InvalidArgumentError, match="segments"):
        ucx.data_plane().submit_get_parts(NS.id, keys, parts, NS.block_bytes)
    assert ucx.put_chain(NS.id, keys[:1], _blocks(1, seed=12)).num_stored == 1


def test_ucx_transport_without_data_plane_raises(store_factory):
    store = store_factory("--dataplane", "none")
    with Client(store.address, timeout_s=5.0, transport="ucx") as client:
        client.register_namespace(NS)
        with pytest.raises(errors.UnavailableError):
            client.put(NS.id, _chain(1), _blocks(1))
    with Client(store.address, timeout_s=5.0) as client:  # auto falls back to gRPC
        client.register_namespace(NS)
        assert client.put(NS.id, _chain(1), _blocks(1)).num_stored == 1
        out = [np.zeros(NS.block_bytes, np.uint8)]
        assert client.get_into(NS.id, _chain(1), out) == (True,)
        assert client.data_plane() is None


def test_closing_a_client_stops_its_worker_cleanly(store):
    """UCXX warns when a worker is destroyed with its request notifier still marked
    running: closing must stop it even when the wake-up lands between two of its waits
    (about 1 close in 4 before the fix, so 20 closes catch it)."""
    script = (
        "import gc, sys\n"
        "import numpy as np\n"
        "from kvstore.client import Client\n"
        "from tests.dataplane.test_dataplane import NS, _chain\n"
        "for seed in range(20):\n"
        "    with Client(sys.argv[1], timeout_s=10.0, transport='ucx') as client:\n"
        "        client.register_namespace(NS)\n"
        "        client.get_into(NS.id, _chain(1, seed), [np.zeros(NS.block_bytes, np.uint8)])\n"
        "    gc.collect()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, store.address],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "should be explicitly stopped" not in done.stdout + done.stderr


def test_eager_puts_store_only_new_blocks_and_keep_present_ones(ucx):
    """After a first put, puts of the namespace send their blocks without waiting for the
    reply; blocks of present keys are drained by the node, never stored over the old."""
    keys, blocks = _chain(8, seed=9), _blocks(8, seed=9)
    assert ucx.put_chain(NS.id, keys[:4], blocks[:4]).num_stored == 4
    others = _blocks(8, seed=10)  # other bytes under the present keys: must not land
    mixed = [*others[:4], *blocks[4:]]
    result = ucx.put_chain(NS.id, keys, mixed)
    assert (result.num_stored, result.num_present) == (4, 4)
    out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
    assert ucx.get_into(NS.id, keys, out) == (True,) * 8
    assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
    # Mostly present: the next put waits for the reply and sends the one new block only.
    keys9, block9 = _chain(9, seed=9), _blocks(9, seed=9)
    assert ucx.put_chain(NS.id, keys9, [*others, block9[8]]).num_stored == 1
    assert ucx.get_into(NS.id, keys9[8:], out[:1]) == (True,)
    assert (out[0] == block9[8]).all()
    wait_no_leases(ucx)


def test_eager_put_refused_by_a_full_node_is_drained_and_the_connection_lives():
    """A refused eager put already sent its blocks: the node drains them, the client gets
    the typed error (not a timeout) and keeps its connection."""
    from kvstore.node.server import EmbeddedServer, ServerConfig
    from kvstore.store.config import StoreConfig

    big = Namespace("llama-dp-big", KVLayout("float16", 4, 8, 128, 16))  # 256 KiB blocks
    store_config = StoreConfig(dram_bytes=8 << 20, slab_bytes=1 << 20)  # 32 blocks
    with (
        EmbeddedServer(store_config, ServerConfig(port=0, transfer_timeout_s=5.0)) as node,
        Client(node.address, timeout_s=30.0, transport="ucx") as client,
    ):
        client.register_namespace(big)
        keys = block_keys(big, np.arange(40 * big.block_tokens))
        blocks = [np.full(big.block_bytes, i, np.uint8) for i in range(40)]
        assert client.put_chain(big.id, keys[:1], blocks[:1]).num_stored == 1
        client_id = client.data_plane().client_id
        with pytest.raises(errors.StoreFullError):
            client.put_chain(big.id, keys[1:], blocks[1:], parent=keys[0])
        stored = client.put_chain(big.id, keys[:3], blocks[:3])  # the refusal evicted keys[0]
        assert stored.num_stored + stored.num_present == 3
        out = [np.zeros(big.block_bytes, np.uint8) for _ in range(3)]
        assert client.get_into(big.id, keys[:3], out) == (True,) * 3
        assert all((o == b).all() for o, b in zip(out, blocks[:3], strict=True))
        assert client.data_plane().client_id == client_id
