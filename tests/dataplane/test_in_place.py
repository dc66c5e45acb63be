"""Memory a process already has, shared in place with a node on its host (`in_place`,
`Client.share`): the same addresses keep the same bytes, only whole pages inside the
arrays move, files stay within the node's region limit, and blocks there move straight
between the node and the memory (no staging region)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.dataplane.buffers import address_of
from kvstore.dataplane.shm import in_place
from kvstore.dataplane.shm.in_place import PAGE, Window
from kvstore.dataplane.shm.regions import Region
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig

NS = Namespace("in-place", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
REGION_LIMIT = 8 * NS.block_bytes


def _page_aligned(nbytes: int) -> np.ndarray:
    """`nbytes` starting at a page boundary, in memory of this process's own."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -address_of(raw) % PAGE
    return raw[start : start + nbytes]


def _mapped_files(name: str) -> dict[str, set[str]]:
    """This process's mappings of memfd `name`: address ranges by the file's inode."""
    files: dict[str, set[str]] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            if f"memfd:{name}" in line:
                fields = line.split()
                files.setdefault(fields[4], set()).add(fields[0])
    return files


def test_address_of_is_where_the_bytes_start_writable_read_only_or_empty():
    base = np.zeros(4 * PAGE, np.uint8)
    start = base.__array_interface__["data"][0]
    read_only = base[PAGE:].view()
    read_only.flags.writeable = False
    cases = [
        (base, start),
        (base[100:], start + 100),
        (memoryview(base)[7:], start + 7),
        (read_only, start + PAGE),
        (base[5:5], None),  # empty: no bytes to place, as numpy says
        (bytearray(b"x"), None),
    ]
    for buf, want in cases:
        got = address_of(buf)
        assert got == np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
        assert want is None or got == want


def test_interiors_are_the_whole_pages_inside_arrays_that_touch_or_overlap_merged():
    memory = _page_aligned(10 * PAGE)
    a, b, c = memory[100 : 3 * PAGE], memory[3 * PAGE : 5 * PAGE + 7], memory[8 * PAGE - 1 :]
    base = address_of(memory)
    assert in_place.interiors([c, b, a]) == [(base + PAGE, 4 * PAGE), (base + 8 * PAGE, 2 * PAGE)]
    assert in_place.interiors([memory[1 : PAGE + 1], memory[:0]]) == []  # no whole page
    assert in_place.interiors([memory[: 2 * PAGE], memory[PAGE : 3 * PAGE]]) == [(base, 3 * PAGE)]


def test_layout_keeps_spans_whole_in_a_file_and_splits_only_those_larger_than_one():
    spans = [(1 << 20, 3 * PAGE), (8 << 20, 4 * PAGE), (9 << 20, PAGE), (16 << 20, 12 * PAGE)]
    assert in_place.layout(spans, 5 * PAGE + 100) == [
        [Window(1 << 20, 3 * PAGE, 0)],
        [Window(8 << 20, 4 * PAGE, 0), Window(9 << 20, PAGE, 4 * PAGE)],
        [Window(16 << 20, 5 * PAGE, 0)],
        [Window((16 << 20) + 5 * PAGE, 5 * PAGE, 0)],
        [Window((16 << 20) + 10 * PAGE, 2 * PAGE, 0)],
    ]
    assert in_place.layout([], PAGE) == []


def test_memory_moved_in_place_keeps_its_bytes_and_is_the_files():
    """The arrays read what they held; a write through the file shows in the array and the
    other way round; the partial pages at the ends are not moved."""
    memory = _page_aligned(6 * PAGE)
    memory[:] = np.random.default_rng(0).integers(0, 256, memory.nbytes, dtype=np.uint8)
    before = memory.copy()
    array = memory[10 : 5 * PAGE + 10]  # whole pages 1..4 inside it
    files = []

    def hand_over(fd: int, windows: list[Window]) -> None:
        files.append((mmap.mmap(os.dup(fd), 0), windows))

    assert in_place.share([array], 2 * PAGE, hand_over, lambda *_: False) == 4 * PAGE
    assert (memory == before).all()
    assert [w for _, w in files] == [
        [Window(address_of(memory) + PAGE, 2 * PAGE, 0)],
        [Window(address_of(memory) + 3 * PAGE, 2 * PAGE, 0)],
    ]
    second = np.frombuffer(files[1][0], np.uint8)
    second[5] = memory[3 * PAGE + 5] ^ 0xFF
    assert memory[3 * PAGE + 5] == second[5]
    memory[4 * PAGE] ^= 0xFF
    assert second[PAGE] == memory[4 * PAGE]
    moved = _mapped_files("kvstore-in-place")
    assert len(moved) >= 2  # two files, each mapped here (and by the test's own mmap)
    start, end = f"{address_of(memory):x}", f"{address_of(memory) + 6 * PAGE:x}"
    assert not any(r.startswith(start) or r.endswith(end) for s in moved.values() for r in s)


def _mapped_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) this process has pages mapped for (Rss)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = address <= start and end <= address + nbytes
            elif head == "Rss:" and inside:
                total += int(line.split()[1]) << 10
    return total


def test_first_touches_are_paid_when_memory_is_shared_not_by_the_first_copy():
    """Memory moved in place is mapped page by page at once on this side; the node's
    mapping of a file maps every page the file holds, and leaves its holes holes."""
    memory = _page_aligned(8 * PAGE)
    memory[:] = 7
    windows: list[Window] = []
    in_place.share([memory], 8 * PAGE, lambda fd, w: windows.extend(w), lambda *_: False)
    assert [w.nbytes for w in windows] == [8 * PAGE]
    assert _mapped_bytes(address_of(memory), 8 * PAGE) == 8 * PAGE

    region, fd = Region.create(16 * PAGE)
    try:
        region.array[: 3 * PAGE] = 1  # pages 0-2 and 9 are the file's, the rest holes
        region.array[9 * PAGE + 5] = 2
        held = os.fstat(fd).st_blocks
        node = Region.admit(fd, 16 * PAGE)
        assert _mapped_bytes(address_of(node.array), node.size) == 4 * PAGE
        assert os.fstat(fd).st_blocks == held  # nothing allocated by the node
        assert node.array[9 * PAGE + 5] == 2 and node.array[PAGE] == 1
        node.close()
    finally:
        region.close()
        os.close(fd)


@pytest.fixture(scope="module")
def node():
    config = ServerConfig(port=0, dataplane="shm", max_shm_region_bytes=REGION_LIMIT)
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    with EmbeddedServer(store, config) as server:
        with Client(server.address, transport="grpc") as client:
            client.register_namespace(NS)
        yield server


def _blocks(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]


def test_blocks_in_memory_shared_in_place_move_straight_to_and_from_the_node(node):
    """A put from memory shared in place and a get into it need no staging region (none
    grows, though a staged call of these would); the node stores and returns the same
    bytes; a block touching an end page, which is not shared, still moves, through
    staging."""
    keys, blocks = _blocks(6, 1)
    memory = np.empty(8 * NS.block_bytes + 100, np.uint8)  # not page aligned: ends unshared
    rows = memory[100:].reshape(8, NS.block_bytes)  # rows 0 and 7 touch the end pages
    with Client(node.address, transport="shm") as client:
        client.register_namespace(NS)
        before = _mapped_files("kvstore-in-place")
        shared = client.share([rows])
        assert shared == sum(nbytes for _, nbytes in in_place.interiors([rows]))
        assert shared >= 7 * NS.block_bytes
        assert len(set(_mapped_files("kvstore-in-place")) - set(before)) == 1  # one file
        assert client.share([]) == 0
        assert client.share([rows, rows[2:4]]) == 0  # shared already: left as it is
        staging = _mapped_files("kvstore-dataplane")  # its first region, at the handshake
        rows[1:7] = blocks
        assert client.put_chain(NS.id, keys, list(rows[1:7])).num_stored == 6
        rows[1:7] = 0
        assert client.get_into(NS.id, keys, list(rows[1:7])) == (True,) * 6
        assert _mapped_files("kvstore-dataplane") == staging  # no staging region grew
        assert all((row == block).all() for row, block in zip(rows[1:7], blocks, strict=True))
        assert client.get_into(NS.id, keys[:1], [rows[7]]) == (True,)  # the unshared end
        assert (rows[7] == blocks[0]).all()
    with Client(node.address, transport="grpc") as other:
        assert [bytes(b) for b in other.get(NS.id, keys).blocks] == [b.tobytes() for b in blocks]
        other.remove(NS.id, keys)


def test_sharing_past_the_nodes_region_count_is_a_typed_error():
    config = ServerConfig(port=0, dataplane="shm", max_shm_region_bytes=64 << 10, max_shm_regions=3)
    node = EmbeddedServer(StoreConfig(dram_bytes=16 << 20), config)
    with node, Client(node.address, transport="shm") as client:
        memory = _page_aligned(5 * (64 << 10))  # five files of 64 KiB; two fit
        with pytest.raises(errors.InvalidArgumentError, match="max_shm_regions"):
            client.share([memory])
        with pytest.raises(errors.InvalidArgumentError, match="max_shm_regions"):
            client.buffer(4096)
        client.register_namespace(NS)  # the connection still serves, through staging
        keys, blocks = _blocks(1, 2)
        assert client.put_chain(NS.id, keys, blocks).num_stored == 1
        out = np.zeros(NS.block_bytes, np.uint8)
        assert client.get_into(NS.id, keys, [out]) == (True,)
        assert (out == blocks[0]).all()
        assert client.data_plane().is_open
