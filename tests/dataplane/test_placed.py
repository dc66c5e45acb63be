"""Rows of memory shared with a node, placed once for many gets (`placed`,
`ShmClient.place`, `ShmClient.submit_get_placed`), against a real node process: each part
lands in its row and is checked, rows and connections are named exactly, and a get makes
no Python object per part."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.dataplane.buffers import address_of
from kvstore.dataplane.shm.in_place import PAGE
from kvstore.keys import KVLayout, Namespace, block_keys

NS = Namespace("placed", KVLayout("float32", 4, 2, 32, 16))  # 4 parts of 4 KiB a block
PARTS, ROWS = 4, 64
ROW_BYTES = NS.block_bytes // PARTS


def _layers() -> list[np.ndarray]:
    """Per part, ROWS rows of ROW_BYTES, page aligned: every row can be shared."""
    raw = np.zeros(PARTS * ROWS * ROW_BYTES + PAGE, np.uint8)
    start = -address_of(raw) % PAGE
    return list(raw[start : start + PARTS * ROWS * ROW_BYTES].reshape(PARTS, ROWS, ROW_BYTES))


def _published(client: Client, n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    keys = block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)
    rng = np.random.default_rng(seed)
    blocks = [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]
    assert client.put_chain(NS.id, keys, blocks).num_stored == n
    return keys, blocks


@pytest.fixture
def shared(store):
    """A client over shared memory, its namespace registered, and page-aligned layers
    shared with the node and placed."""
    with Client(store.address, transport="shm") as client:
        client.register_namespace(NS)
        layers = _layers()
        assert client.share(layers) == PARTS * ROWS * ROW_BYTES
        dataplane = client.data_plane()
        yield client, dataplane, layers, dataplane.place(layers)


def test_a_get_into_placed_rows_lands_each_part_in_its_row_checked(shared):
    client, dataplane, layers, placed = shared
    keys, blocks = _published(client, 5, 1)
    missing = block_keys(NS, np.arange(NS.block_tokens) + 99_000_000)[0]
    rows, parts_done = [7, 2, 40, 9, 63, 0], []
    found = dataplane.submit_get_placed(NS.id, [*keys, missing], placed, rows, parts_done.append)
    assert found.result() == (True,) * 5 + (False,)
    assert parts_done == list(range(PARTS))
    for block, row in zip(blocks, rows, strict=False):
        landed = np.concatenate([layers[s][row] for s in range(PARTS)])
        assert (landed == block).all()
    assert not layers[0][0].any()  # the missing key's row is untouched
    assert dataplane.checksum_failures == 0


def test_placed_rows_are_named_exactly_and_belong_to_one_connection(store, shared):
    client, dataplane, _, placed = shared
    keys, _ = _published(client, 2, 2)
    for rows in ([0, ROWS], [-1, 3]):
        with pytest.raises(errors.InvalidArgumentError, match="out of range"):
            dataplane.submit_get_placed(NS.id, keys, placed, rows)
    with pytest.raises(errors.InvalidArgumentError):
        dataplane.submit_get_placed(NS.id, keys, placed, [1])  # fewer rows than keys
    with pytest.raises(errors.BadKeyError):
        dataplane.submit_get_placed(NS.id, [b"short", keys[1]], placed, [1, 2])
    with (
        Client(store.address, transport="shm") as other,
        pytest.raises(errors.InvalidArgumentError, match="another connection"),
    ):
        other.data_plane().submit_get_placed(NS.id, keys, placed, [1, 2])
    assert dataplane.submit_get_placed(NS.id, keys, placed, [1, 2]).result() == (True, True)


def test_rows_outside_shared_memory_send_nothing_and_bad_arrays_are_refused(store):
    with Client(store.address, transport="shm") as client:
        client.register_namespace(NS)
        keys, _ = _published(client, 1, 3)
        memory = np.zeros(ROWS * ROW_BYTES + 100, np.uint8)
        rows = memory[100:].reshape(ROWS, ROW_BYTES)  # rows 0 and 63 touch the end pages
        client.share([rows])
        dataplane = client.data_plane()
        placed = dataplane.place([rows])
        assert dataplane.submit_get_placed(NS.id, keys, placed, [ROWS - 1]) is None
        assert not rows[ROWS - 1].any()
        bad = [
            [rows.view(np.int32)],  # not bytes
            [rows[:, ::2]],  # not contiguous
            [rows, rows[:10]],  # not of one shape
            [],
        ]
        read_only = rows.copy()
        read_only.flags.writeable = False
        for arrays in [*bad, [read_only]]:
            with pytest.raises(errors.InvalidArgumentError):
                dataplane.place(arrays)
        assert client.get(NS.id, keys).found == (True,)  # the connection still serves


def test_a_get_into_placed_rows_makes_no_python_object_per_part(shared):
    """A get by parts wraps every part (several objects each), which in a large heap
    starts collections; into placed rows it does not: over the same gets of 64 blocks of
    4 parts, at most a quarter of the collections."""
    client, dataplane, layers, placed = shared
    keys, _ = _published(client, 64, 4)
    rows = list(range(ROWS))

    def collections(get) -> int:
        started = []
        callback = lambda phase, info: started.append(info) if phase == "start" else None  # noqa: E731
        gc.collect()
        gc.callbacks.append(callback)
        try:
            for _ in range(20):
                assert all(get().result())
        finally:
            gc.callbacks.remove(callback)
        return len(started)

    def by_parts():
        parts = [[layer[r] for r in rows] for layer in layers]
        return dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes)

    wrapped = collections(by_parts)
    placed_ones = collections(lambda: dataplane.submit_get_placed(NS.id, keys, placed, rows))
    assert wrapped >= 8  # the measure sees the objects it is meant to see
    assert placed_ones <= wrapped // 4
