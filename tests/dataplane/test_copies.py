"""Block copies of the same-host plane (`regions.copy`, `regions.copy_summed`): in pieces of
half a core's L2 cache, byte for byte whatever the size, and the piece read from Linux."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.checksum import checksum
from kvstore.dataplane.shm import regions

PIECE = 4096  # small pieces, so blocks of a few pieces stay small


@pytest.mark.parametrize("nbytes", [1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 5])
def test_a_copy_in_pieces_is_byte_for_byte_and_sums_the_copy(monkeypatch, nbytes):
    monkeypatch.setattr(regions, "PIECE_BYTES", PIECE)
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    regions.copy(dst, src)
    assert (dst == src).all()
    summed = np.zeros(nbytes, np.uint8)
    assert regions.copy_summed(summed, src, 7) == checksum(src, 7)
    assert (summed == src).all()


def test_a_copy_between_sizes_that_differ_is_refused(monkeypatch):
    monkeypatch.setattr(regions, "PIECE_BYTES", PIECE)
    dst = np.zeros(2 * PIECE, np.uint8)
    for copy in (regions.copy, regions.copy_summed):
        with pytest.raises(ValueError, match="copy of"):
            copy(dst, np.ones(2 * PIECE + 1, np.uint8))  # never a broadcast or a short copy
    assert not dst.any()


def _caches(root: Path, *caches: tuple[str, str, str]) -> Path:
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir()
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


@pytest.mark.parametrize(
    ("l2", "piece"), [("1024K", 512 << 10), ("512K", 256 << 10), ("2M", 1 << 20), ("96K", 64 << 10)]
)
def test_a_piece_is_half_the_l2_cache_linux_reports(tmp_path, l2, piece):
    caches = _caches(
        tmp_path,
        ("1", "Data", "32K"),
        ("1", "Instruction", "32K"),
        ("2", "Unified", l2),
        ("3", "Unified", "32768K"),
    )
    assert regions._piece_bytes(caches) == piece


def test_a_piece_is_512_kib_where_linux_does_not_say(tmp_path):
    assert regions._piece_bytes(tmp_path / "absent") == 512 << 10
    assert regions._piece_bytes(_caches(tmp_path, ("2", "Unified", "lots"))) == 512 << 10
