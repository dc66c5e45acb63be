"""Block checksums: CRC32C (Castagnoli), as iSCSI, ext4 and RocksDB use it.

CRC32C has a CPU instruction on x86-64 (SSE4.2) and arm64 (CRC extension), which the
`crc32c` package uses (with a software fallback): several times faster than zlib's CRC32.
That matters on the put path, where a block is summed by the sender and again by the node
before it is committed. The package releases the GIL for large buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import crc32c


def checksum(data: Any, crc: int = 0) -> int:
    """The CRC32C of a buffer (bytes, memoryview, contiguous numpy array), as uint32;
    given `crc`, the CRC32C of bytes that had that CRC32C, followed by `data`."""
    return int(crc32c.crc32c(data, crc))


def checksums(buffers: Iterable[Any]) -> list[int]:
    """The CRC32C of each buffer, in one call: the GIL is let go while each block is summed,
    so other threads (a transport's progress, the event loop) run meanwhile."""
    crc = crc32c.crc32c
    return [int(crc(b)) for b in buffers]
