"""The vLLM connector's loader against a real store: pipelined chunks through a fixed staging
pool into vLLM's CPU paged layout, over the data plane and over gRPC. No vLLM needed."""

from __future__ import annotations

import pytest

from tests.conftest import require_extra

torch = require_extra("torch")

from kvstore import errors  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.integrations.load_phases import PhaseClock  # noqa: E402
from kvstore.integrations.vllm import layer_load as vllm_layer_load  # noqa: E402
from kvstore.integrations.vllm.blocks import PagedBlocks  # noqa: E402
from kvstore.integrations.vllm.loader import BlockLoader  # noqa: E402
from kvstore.integrations.vllm.plan import RequestBlocks  # noqa: E402
from kvstore.keys import KVLayout, Namespace  # noqa: E402
from kvstore.node.server import EmbeddedServer, ServerConfig  # noqa: E402
from kvstore.store import StoreConfig  # noqa: E402
from tests.conftest import free_port, start_store, wait_no_leases  # noqa: E402

LAYERS, KV_HEADS, BLOCK, HEAD_DIM, NUM_PAGES = 3, 2, 4, 8, 16
NS = Namespace("vllm/cpu/loader-test", KVLayout("float32", LAYERS, KV_HEADS, HEAD_DIM, BLOCK))
WARM_UP = Namespace("kvstore/warm-up", NS.layout)
SHAPE = (NUM_PAGES, KV_HEADS, BLOCK, 2 * HEAD_DIM)  # vLLM's CPU layout, one per layer


def _pages(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


def _publish(client: Client, src: PagedBlocks, blocks: RequestBlocks, pages: list[int]) -> None:
    staging = src.gather(pages)
    client.put_chain(NS.id, blocks.keys[: len(pages)], PagedBlocks.as_buffers(staging))


def _request(num_blocks: int, dst_pages: list[int]) -> RequestBlocks:
    blocks = RequestBlocks.from_prompt("r", NS, list(range(num_blocks * BLOCK + 1)))
    blocks.block_ids = dst_pages
    return blocks


def _same_block(a: list[torch.Tensor], page_a: int, b: list[torch.Tensor], page_b: int) -> bool:
    return all(torch.equal(x[page_a], y[page_b]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("transport", ["shm", "ucx", "tcp", "grpc"])
@pytest.mark.parametrize("num_buffers", [2, 4, 16])
def test_a_load_in_chunks_fills_every_vllm_block_it_names(store, transport, num_buffers):
    src_tensors, dst_tensors = _pages(0), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    src_pages, dst_pages = [3, 1, 7, 0, 9, 12, 5], [15, 2, 4, 8, 6, 11, 13]
    blocks = _request(len(src_pages), dst_pages)
    with Client(store.address, transport=transport) as client:
        client.register_namespace(NS)
        client.register_namespace(WARM_UP)
        _publish(client, src, blocks, src_pages)
        num_blocks = client.stats().num_blocks
        loader = BlockLoader(client, dst, num_buffers, share_pages=False)  # through the pool
        warm = loader.warm_up(WARM_UP.id)
        phases = {"connect", "stage"} | ({"transfer"} if transport != "grpc" else set())
        assert set(warm.seconds) == phases
        assert warm.num_bytes == num_buffers * dst.block_bytes
        assert client.stats().num_blocks == num_blocks  # the warm-up block is gone
        result = loader.load(blocks.transfer(0, len(src_pages)))
        assert (result.num_loaded, result.error) == (len(src_pages), None)
        assert result.phases.num_bytes == len(src_pages) * dst.block_bytes
        assert {"connect", "submit", "transfer", "scatter"} <= set(result.phases.seconds)
        second = loader.load(blocks.transfer(2, 5))  # the pool is reused
        assert second.num_loaded == 3
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert _same_block(src_tensors, s, dst_tensors, d)
    untouched = set(range(NUM_PAGES)) - set(dst_pages)
    assert all(not t[p].any() for t in dst_tensors for p in untouched)


@pytest.mark.parametrize("num_buffers", [2, 8])
def test_a_load_stops_at_the_first_missing_block_and_fills_only_the_prefix(store, num_buffers):
    src_tensors, dst_tensors = _pages(1), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = _request(6, [10, 11, 12, 13, 14, 15])
    with Client(store.address) as client:
        client.register_namespace(NS)
        _publish(client, src, blocks, [0, 1, 2, 3, 4, 5])
        client.remove(NS.id, [blocks.keys[3]])  # evicted between match and load
        loader = BlockLoader(client, dst, num_buffers)
        result = loader.load(blocks.transfer(0, 6))
        assert (result.num_loaded, result.error) == (3, None)
        assert result.phases.num_blocks == 3
        again = loader.load(blocks.transfer(0, 3))  # nothing of the cut load is in flight
        assert again.num_loaded == 3
    assert all(_same_block(src_tensors, i, dst_tensors, 10 + i) for i in range(3))
    assert all(not t[p].any() for t in dst_tensors for p in (13, 14, 15))


def test_a_store_gone_mid_session_is_an_error_with_nothing_loaded(store_factory):
    store = store_factory("--dram-bytes", "16MiB")
    dst_tensors = _pages(None)
    dst = PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = _request(4, [0, 1, 2, 3])
    with Client(store.address, timeout_s=2.0) as client:
        client.register_namespace(NS)
        loader = BlockLoader(client, dst, 2)
        loader.warm_up()
        assert store.stop() == 0  # SIGTERM: gone, and its address checker with it
        result = loader.load(blocks.transfer(0, 4))
    assert result.num_loaded == 0
    assert result.error is not None
    assert not any(t.any() for t in dst_tensors)


# -- vLLM's pages shared with the node --------------------------------------------------------

BIG = Namespace("vllm/cpu/shared-pages", KVLayout("float32", LAYERS, 2, 64, 16))  # 16 KiB a layer
BIG_SHAPE = (NUM_PAGES, 2, 16, 2 * 64)


@pytest.mark.parametrize("by_layer", [False, True])
def test_pages_shared_with_a_node_on_this_host_take_loads_straight(store, by_layer):
    """Over shared memory the warm-up moves vLLM's pages onto files the node maps, so a
    load lands straight in the pages: no staging pool, no scatter."""
    gen = torch.Generator().manual_seed(4)
    src_tensors = [torch.randn(BIG_SHAPE, generator=gen) for _ in range(LAYERS)]
    dst_tensors = [torch.randn(BIG_SHAPE, generator=gen) for _ in range(LAYERS)]
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = RequestBlocks.from_prompt("r", BIG, list(range(6 * 16 + 1)))
    blocks.block_ids = [9, 2, 4, 8, 6, 11]  # inside the pages' shared interior
    with Client(store.address, transport="shm") as client:
        client.register_namespace(BIG)
        client.register_namespace(Namespace("kvstore/warm-up", BIG.layout))
        client.put_chain(BIG.id, blocks.keys[:6], PagedBlocks.as_buffers(src.gather(range(6))))
        loader = BlockLoader(client, dst, 2, by_layer=by_layer)
        assert loader.shared_bytes == 0
        warm = loader.warm_up(Namespace("kvstore/warm-up", BIG.layout).id)
        page_bytes = NUM_PAGES * dst.block_bytes // LAYERS
        assert loader.shared_bytes >= LAYERS * (page_bytes - 2 * 4096)
        assert warm.num_bytes == 2 * dst.block_bytes  # the staging blocks; the pages are mapped
        layer_load = loader.start_layers(blocks.transfer(0, 6))
        if layer_load is not None:  # parts land part-major: each wait, its layer is in
            for layer in range(LAYERS):
                layer_load.wait_layer(layer)
                pairs = enumerate(blocks.block_ids)
                assert all(
                    torch.equal(src_tensors[layer][i], dst_tensors[layer][p]) for i, p in pairs
                )
            result = layer_load.finish()
        else:
            result = loader.load(blocks.transfer(0, 6))
        assert (result.num_loaded, result.error) == (6, None)
        assert "scatter" not in result.phases.seconds
    for i, page in enumerate(blocks.block_ids):
        assert _same_block(src_tensors, i, dst_tensors, page)


def _file_of(tensor: torch.Tensor) -> str | None:
    """The inode of the shared file that holds the middle of `tensor`'s memory, if any."""
    middle = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, _, inode, *name = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= middle < end and name and "kvstore-in-place" in name[0]:
                return inode
    return None


def test_pages_are_shared_again_with_a_restarted_node(tmp_path):
    """The node goes and another comes up at its address: the next load, over a new
    connection, shares the pages with the new node first (else every load would go through
    staging) and lands straight in them."""
    port = str(free_port())
    gen = torch.Generator().manual_seed(5)
    src_tensors = [torch.randn(BIG_SHAPE, generator=gen) for _ in range(LAYERS)]
    dst_tensors = [torch.zeros(BIG_SHAPE) for _ in range(LAYERS)]
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = RequestBlocks.from_prompt("r", BIG, list(range(4 * 16 + 1)))
    blocks.block_ids = [3, 5, 7, 9]
    first = start_store(tmp_path, "--port", port)
    with Client(first.address, timeout_s=5.0, transport="shm") as client:
        client.register_namespace(BIG)
        loader = BlockLoader(client, dst, 2)
        loader.warm_up()
        shared, before = loader.shared_bytes, _file_of(dst_tensors[0])
        assert shared > 0 and before is not None
        assert first.stop() == 0
        second = start_store(tmp_path, "--port", port)
        try:
            client.register_namespace(BIG)
            staging = PagedBlocks.as_buffers(src.gather(range(4)))
            with pytest.raises(errors.UnavailableError):  # the old connection: its node is gone
                client.put_chain(BIG.id, blocks.keys[:4], staging)
            client.put_chain(BIG.id, blocks.keys[:4], staging)  # over a new one
            result = loader.load(blocks.transfer(0, 4))
            assert (result.num_loaded, result.error) == (4, None)
            assert "share" in result.phases.seconds and "scatter" not in result.phases.seconds
            assert loader.shared_bytes == shared
            assert _file_of(dst_tensors[0]) not in (None, before)  # a new file, the new node's
        finally:
            assert second.stop() == 0
    for i, page in enumerate(blocks.block_ids):
        assert _same_block(src_tensors, i, dst_tensors, page)


# -- layer by layer, straight into the pages ------------------------------------------------


def _layer_load_of(client: Client, dst: PagedBlocks, blocks: RequestBlocks, num: int):
    layer_load = BlockLoader(client, dst, 2, by_layer=True).start_layers(blocks.transfer(0, num))
    assert layer_load is not None, "the CPU layout over the data plane loads by layer"
    return layer_load


@pytest.mark.parametrize("tagged_parts", [1 << 16, 2 * LAYERS])  # one GET; two blocks a GET
def test_a_load_by_layer_lands_each_layer_of_every_block_before_its_wait_returns(
    store, monkeypatch, tagged_parts
):
    """Each `wait_layer(s)` returns with layer s of every block in its page; `finish`
    counts them all; every other page is untouched (no staging, no scatter)."""
    monkeypatch.setattr(vllm_layer_load, "MAX_TAGGED_PARTS", tagged_parts)
    src_tensors, dst_tensors = _pages(2), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    src_pages, dst_pages = [3, 1, 7, 0, 9], [15, 2, 4, 8, 6]
    blocks = _request(len(src_pages), dst_pages)
    with Client(store.address, transport="ucx") as client:
        client.register_namespace(NS)
        _publish(client, src, blocks, src_pages)
        layer_load = _layer_load_of(client, dst, blocks, len(src_pages))
        for layer in range(LAYERS):
            layer_load.wait_layer(layer)
            pairs = zip(src_pages, dst_pages, strict=True)
            assert all(torch.equal(src_tensors[layer][s], dst_tensors[layer][d]) for s, d in pairs)
        result = layer_load.finish()
        wait_no_leases(client)
    assert (result.num_loaded, result.error) == (len(src_pages), None)
    assert result.phases.num_bytes == len(src_pages) * dst.block_bytes
    assert {"connect", "submit", "transfer"} <= set(result.phases.seconds)
    pairs = zip(src_pages, dst_pages, strict=True)
    assert all(_same_block(src_tensors, s, dst_tensors, d) for s, d in pairs)
    untouched = set(range(NUM_PAGES)) - set(dst_pages)
    assert all(not t[p].any() for t in dst_tensors for p in untouched)


@pytest.mark.parametrize("damage", ["removed", "corrupted"])
def test_a_load_by_layer_counts_only_the_whole_prefix(damage):
    """A block evicted since the match, or one whose bytes fail their CRC32C (found only
    once its last layer is in): the load counts the blocks before it, and vLLM is told the
    rest failed (it recomputes them and drops what the forward made of them)."""
    src_tensors, dst_tensors = _pages(3), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = _request(5, [10, 11, 12, 13, 14])
    store_config = StoreConfig(dram_bytes=16 << 20, slab_bytes=1 << 20)
    node = EmbeddedServer(store_config, ServerConfig(port=0))
    with node, Client(node.address, transport="ucx") as client:
        client.register_namespace(NS)
        _publish(client, src, blocks, [0, 1, 2, 3, 4])
        if damage == "removed":
            client.remove(NS.id, [blocks.keys[2]])
        else:  # a byte of its last layer, flipped behind the store's back
            lease = node.store.acquire(NS.id, blocks.keys[2:3])
            lease.views[0][-1] ^= 0xFF
            lease.release()
        layer_load = _layer_load_of(client, dst, blocks, 5)
        for layer in range(LAYERS):
            layer_load.wait_layer(layer)
        result = layer_load.finish()
        assert client.data_plane().checksum_failures == (damage == "corrupted")
    assert (result.num_loaded, result.error) == (2, None)
    assert all(_same_block(src_tensors, i, dst_tensors, 10 + i) for i in range(2))


def test_a_load_by_layer_from_a_store_gone_ends_every_wait_with_nothing_loaded(store_factory):
    store = store_factory("--dram-bytes", "16MiB")
    dst = PagedBlocks(_pages(None), NUM_PAGES)
    blocks = _request(4, [0, 1, 2, 3])
    with Client(store.address, timeout_s=2.0, transport="ucx") as client:
        client.register_namespace(NS)
        client.data_plane()  # connected before the store goes
        assert store.stop() == 0
        layer_load = _layer_load_of(client, dst, blocks, 4)
        for layer in range(LAYERS):
            layer_load.wait_layer(layer)  # returns: the load has failed
        result = layer_load.finish()
    assert result.num_loaded == 0 and result.error is not None


def test_layouts_and_paths_that_cannot_load_by_layer_say_so(store):
    """Over gRPC, with by_layer off, or with a layer's blocks not contiguous (the flash
    layout's K and V planes), `start_layers` is None: the loader's staged `load` is used."""
    blocks = _request(2, [0, 1])
    cpu = PagedBlocks(_pages(None), NUM_PAGES)
    flash = PagedBlocks(
        [torch.zeros(2, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)], NUM_PAGES
    )
    with Client(store.address, transport="grpc") as grpc_client:
        assert (
            BlockLoader(grpc_client, cpu, 2, by_layer=True).start_layers(blocks.transfer(0, 2))
            is None
        )
    with Client(store.address, transport="ucx") as client:
        client.register_namespace(NS)
        for paged, by_layer in ((cpu, False), (flash, True)):
            loader = BlockLoader(client, paged, 2, by_layer=by_layer)
            assert loader.start_layers(blocks.transfer(0, 2)) is None


def test_a_load_on_a_connection_closed_under_it_is_an_error_not_an_exception(store_factory):
    """Another thread's failed call can close the shared data plane between a loader's
    connect and its get; and with transport "ucx" a store that is gone has no data plane:
    either way the load ends with an error and nothing loaded, and vLLM keeps running."""
    store = store_factory("--dram-bytes", "16MiB")
    dst = PagedBlocks(_pages(None), NUM_PAGES)
    blocks = _request(2, [0, 1])
    with Client(store.address, timeout_s=2.0, transport="ucx") as client:
        client.register_namespace(NS)
        dataplane = client.data_plane()
        dataplane.close()
        rows = dst.layer_rows()
        assert rows is not None
        layer_load = vllm_layer_load.LayerLoad(
            dataplane, blocks.transfer(0, 2), rows, dst.block_bytes, 5.0, PhaseClock()
        )
        layer_load.wait_layer(0)
        result = layer_load.finish()
        assert result.num_loaded == 0 and result.error is not None
        assert store.stop() == 0
        loader = BlockLoader(client, dst, 2, by_layer=True)
        assert loader.start_layers(blocks.transfer(0, 2)) is None
        result = loader.load(blocks.transfer(0, 2))
        assert result.num_loaded == 0 and result.error is not None
    assert not any(t.any() for t in dst.layers)
