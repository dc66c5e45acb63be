"""Caller buffers of a call (`buffers.checked_buffers`): a list of blocks, or one array of
a row per key, checked once for the call."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import errors
from kvstore.dataplane.buffers import address_of, checked_buffers

KEYS = [bytes([i]) * 32 for i in range(4)]
BLOCK = 4096


def test_an_array_of_rows_is_its_rows_each_with_its_address():
    rows = np.arange(4 * BLOCK, dtype=np.uint32).view(np.uint8)[: 4 * BLOCK].reshape(4, BLOCK)
    bufs = checked_buffers(KEYS, rows, BLOCK, writable=True)
    assert [bytes(b.obj) for b in bufs] == [r.tobytes() for r in rows]
    assert [b.address for b in bufs] == [address_of(r) for r in rows]
    assert all(b.nbytes == BLOCK and not b.is_device for b in bufs)
    bufs[2].obj[:] = b"\7" * BLOCK  # a row's buffer is the caller's memory, not a copy
    assert (rows[2] == 7).all()
    as_list = checked_buffers(KEYS, list(rows), BLOCK, writable=True)
    assert [bytes(b.obj) for b in as_list] == [bytes(b.obj) for b in bufs]
    assert all(b.address is None for b in as_list)  # read per buffer where it is needed


def test_rows_of_any_dtype_and_shape_are_their_bytes():
    rows = np.ones((4, 2, BLOCK // 8), np.float32)  # 4 rows of 2 x 512 floats: 4 KiB each
    bufs = checked_buffers(KEYS, rows, BLOCK, writable=False)
    assert [b.address for b in bufs] == [address_of(rows[i]) for i in range(4)]
    assert bytes(bufs[3].obj) == rows[3].tobytes()


def test_an_array_of_rows_is_refused_whole_where_its_rows_would_be():
    with pytest.raises(errors.PayloadSizeError, match="not 4096"):
        checked_buffers(KEYS, np.zeros((4, BLOCK + 1), np.uint8), BLOCK, writable=True)
    with pytest.raises(errors.InvalidArgumentError, match="3 buffers for 4 keys"):
        checked_buffers(KEYS, np.zeros((3, BLOCK), np.uint8), BLOCK, writable=True)
    frozen = np.zeros((4, BLOCK), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        checked_buffers(KEYS, frozen, BLOCK, writable=True)
    assert len(checked_buffers(KEYS, frozen, BLOCK, writable=False)) == 4  # a put reads it


def test_arrays_of_python_objects_are_refused_as_rows_and_one_by_one():
    """Their bytes are pointers: a get landing there would corrupt the caller's process."""
    objects = np.empty((4, BLOCK // 8), dtype=object)
    for buffers in (objects, list(objects)):
        with pytest.raises(errors.InvalidArgumentError, match="Python objects"):
            checked_buffers(KEYS, buffers, BLOCK, writable=True)


def test_rows_not_contiguous_as_a_whole_are_taken_one_by_one():
    every_other = np.zeros((8, BLOCK), np.uint8)[::2]  # each row contiguous, not the array
    every_other[1] = 5
    bufs = checked_buffers(KEYS, every_other, BLOCK, writable=True)
    assert bytes(bufs[1].obj) == b"\5" * BLOCK and all(b.address is None for b in bufs)
    with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
        checked_buffers(KEYS, np.zeros((4, 2 * BLOCK), np.uint8)[:, ::2], BLOCK, writable=True)
