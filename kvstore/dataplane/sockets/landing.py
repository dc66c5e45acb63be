"""A same-host GET call's blocks as they land (`shm.client`): each found block is taken
(checked where the caller reads it, copied out of the staging region first if it landed
there) as soon as the node says it landed, while the node copies the next ones.

A call in parts lands part-major (part s of every block before part s + 1: layer s of a
KV block before layer s + 1), and is noted unit by unit, unit `s * num_keys + i` being
part s of key i. A block's CRC32C is then taken part by part, each part continuing the
sum of the ones before, and `on_part(s)` says part s of every found block is in while
later parts are still being copied; the block is known whole at its last part.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstore.checksum import checksum
from kvstore.dataplane.buffers import TransferBuffer, write_host_bytes
from kvstore.dataplane.frames import Reply
from kvstore.dataplane.shm.regions import Region, copy_summed

Take = Callable[[int, int, int], int]  # (part, key, CRC32C so far) -> CRC32C after it


class Landing:
    """One GET call of `num_keys` keys in `num_parts` parts: `take(s, i, crc)` takes part s
    of key i's landed block and returns the CRC32C (continuing `crc`) as the caller will
    read it; `note` is a LANDED note, `finish` the reply; `on_part(s)` once part s of every
    found block has landed.

    A stream the node broke (a note for another call, out of order, past the call's units,
    flags that differ between parts of a key, or that the reply then contradicts) raises
    ConnectionError: the connection is unusable.
    """

    def __init__(
        self,
        request_id: int,
        num_keys: int,
        take: Take,
        num_parts: int = 1,
        on_part: Callable[[int], None] | None = None,
    ) -> None:
        self.request_id, self.num_keys, self.num_parts = request_id, num_keys, num_parts
        self._take, self._on_part = take, on_part
        self._flags = b""  # of the units said to have landed, from the first
        self._sums = [0] * num_keys  # CRC32C of each key's block, over its parts taken

    def note(self, request_id: int, first: int, flags: bytes) -> None:
        """Takes the found parts of units `first`.. (one flag each) the node says landed."""
        said, num_keys = len(self._flags), self.num_keys
        if (
            request_id != self.request_id
            or first != said
            or first + len(flags) > num_keys * self.num_parts
        ):
            raise ConnectionError("data-plane landed note is out of step")
        self._flags += flags
        if any(
            self._flags[u] != self._flags[u - num_keys]
            for u in range(max(said, num_keys), len(self._flags))
        ):
            raise ConnectionError("data-plane landed note differs between parts of a key")
        for unit in range(said, len(self._flags)):
            if self._flags[unit]:
                part, key = divmod(unit, num_keys)
                self._sums[key] = self._take(part, key, self._sums[key])
        self._parts_done(said // num_keys, len(self._flags) // num_keys)

    def finish(self, reply: Reply) -> list[bool]:
        """Which keys were found with their CRC32C: the reply's flags must agree with the
        notes; parts no note named are taken now. Failing blocks are not found."""
        flags, said, num_keys = reply.flags, len(self._flags), self.num_keys
        hits = [i for i, f in enumerate(flags) if f]
        if (
            len(flags) != num_keys
            or any(f not in (0, 1) for f in flags)
            or any(self._flags[u] != flags[u % num_keys] for u in range(said))
            or len(reply.checksums) != len(hits)
        ):
            raise ConnectionError("data-plane get reply is malformed")
        for unit in range(said, num_keys * self.num_parts):
            part, key = divmod(unit, num_keys)
            if flags[key]:
                self._sums[key] = self._take(part, key, self._sums[key])
        self._parts_done(said // num_keys, self.num_parts)
        found = [False] * num_keys
        for i, want in zip(hits, reply.checksums, strict=True):
            found[i] = self._sums[i] == want
        return found

    def _parts_done(self, before: int, after: int) -> None:
        if self._on_part is not None:
            for part in range(before, after):
                self._on_part(part)


# -- taking a landed block -------------------------------------------------------------


def summed(parts: list[list[TransferBuffer]], s: int, i: int, crc: int) -> int:
    """The CRC32C of part s of key i's block in shared buffers, continuing `crc`."""
    return checksum(parts[s][i].obj, crc)


def copied_out(
    parts: list[list[TransferBuffer]], region: Region, base: int, s: int, i: int, crc: int
) -> int:
    """Copies part s of key i's block from the staging region (block i whole at `base + i *
    block_bytes`) into its buffer; returns its CRC32C as the caller will read it,
    continuing `crc`."""
    size = parts[s][i].nbytes
    start = base + (i * len(parts) + s) * size
    return _write(parts[s][i], region.array[start : start + size], crc)


def _write(buf: TransferBuffer, landed: np.ndarray, crc: int) -> int:
    """Copies `landed` into the caller's buffer; returns the CRC32C (continuing `crc`) of
    the caller's own copy on the host, or of the region's for device memory (which the
    host cannot read)."""
    if buf.is_device:
        write_host_bytes(buf, landed)
        return checksum(landed, crc)
    return copy_summed(np.frombuffer(buf.obj, np.uint8), landed, crc)
