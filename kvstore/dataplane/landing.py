"""A same-host GET call's blocks as they land (`shm_client`): each found block is taken
(checked where the caller reads it, copied out of the staging region first if it landed
there) as soon as the node says it landed, while the node copies the next ones.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.checksum import checksum
from kvstore.dataplane.buffers import TransferBuffer, write_host_bytes
from kvstore.dataplane.frames import Reply
from kvstore.dataplane.regions import Region, copy_summed


class Landing:
    """One GET call of `num_keys` keys: `take(i)` takes key i's landed block and returns
    its CRC32C as the caller will read it; `note` is a LANDED note, `finish` the reply.

    A stream the node broke (a note for another call, out of order, past the keys, or
    flags the reply then contradicts) raises ConnectionError: the connection is unusable.
    """

    def __init__(self, request_id: int, num_keys: int, take: Callable[[int], int]) -> None:
        self.request_id, self.num_keys = request_id, num_keys
        self._take = take
        self._flags = b""  # of the keys said to have landed, from the first
        self._sums: dict[int, int] = {}  # key -> CRC32C of its taken block

    def note(self, request_id: int, first: int, flags: bytes) -> None:
        """Takes the found blocks of keys `first`.. (one flag each) the node says landed."""
        if (
            request_id != self.request_id
            or first != len(self._flags)
            or first + len(flags) > self.num_keys
        ):
            raise ConnectionError("data-plane landed note is out of step")
        for i, found in enumerate(flags, first):
            if found:
                self._sums[i] = self._take(i)
        self._flags += flags

    def finish(self, reply: Reply) -> list[bool]:
        """Which keys were found with their CRC32C: the reply's flags must agree with the
        notes; blocks no note named are taken now. Failing blocks are not found."""
        flags, said = reply.flags, len(self._flags)
        hits = [i for i, f in enumerate(flags) if f]
        if (
            len(flags) != self.num_keys
            or any(f not in (0, 1) for f in flags)
            or bytes(flags[:said]) != self._flags
            or len(reply.checksums) != len(hits)
        ):
            raise ConnectionError("data-plane get reply is malformed")
        found = [False] * self.num_keys
        for i, want in zip(hits, reply.checksums, strict=True):
            crc = self._sums[i] if i < said else self._take(i)
            found[i] = crc == want
        return found


# -- taking a landed block -------------------------------------------------------------


def summed(parts: list[list[TransferBuffer]], i: int) -> int:
    """The CRC32C of key i's block in shared buffers, part after part."""
    crc = 0
    for part in parts:
        crc = checksum(part[i].obj, crc)
    return crc


def copied_out(parts: list[list[TransferBuffer]], region: Region, base: int, i: int) -> int:
    """Copies key i's block from the staging region (whole at `base + i * block_bytes`) into
    its parts; returns its CRC32C as the caller will read it."""
    size, crc = parts[0][i].nbytes, 0
    start = base + i * size * len(parts)
    for s, part in enumerate(parts):
        crc = _write(part[i], region.array[start + s * size : start + (s + 1) * size], crc)
    return crc


def _write(buf: TransferBuffer, landed: np.ndarray, crc: int) -> int:
    """Copies `landed` into the caller's buffer; returns the CRC32C (continuing `crc`) of
    the caller's own copy on the host, or of the region's for device memory (which the
    host cannot read)."""
    if buf.is_device:
        write_host_bytes(buf, landed)
        return checksum(landed, crc)
    return copy_summed(np.frombuffer(buf.obj, np.uint8), landed, crc)
