"""`kvstore.checksum`: CRC32C as iSCSI defines it, whatever instructions sum it."""

import crc32c
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvstore.checksum import checksum, checksums


def test_the_published_check_values() -> None:
    assert checksum(b"123456789") == 0xE3069283  # the catalogue's check value
    # RFC 3720, B.4: 32 bytes of zeros, of ones, ascending and descending.
    assert checksum(bytes(32)) == 0x8A9136AA
    assert checksum(b"\xff" * 32) == 0x62A8AB43
    assert checksum(bytes(range(32))) == 0x46DD794E
    assert checksum(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert checksum(b"") == 0


@given(st.binary(max_size=5000), st.integers(0, 5000), st.integers(0, 2**32 - 1))
def test_a_sum_in_pieces_is_the_sum_of_the_whole(data: bytes, cut: int, seed: int) -> None:
    cut = min(cut, len(data))
    whole = checksum(data, seed)
    assert checksum(data[cut:], checksum(data[:cut], seed)) == whole
    assert whole == crc32c.crc32c(data, seed)  # a second implementation agrees


@given(st.integers(1 << 10, 3 << 20), st.integers(0, 63))
def test_large_unaligned_views_sum_as_their_bytes(size: int, offset: int) -> None:
    """The vector paths (blocks of KiB to MiB) at every alignment, read-only or not."""
    block = np.random.default_rng(size).integers(0, 256, size + offset, dtype=np.uint8)
    view = block[offset:]
    expected = crc32c.crc32c(view.tobytes())
    assert checksum(view) == expected
    assert checksum(memoryview(view).toreadonly()) == expected
    assert checksums([view, view[:0]]) == [expected, 0]
