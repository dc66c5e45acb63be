"""Recovery: the index rebuilt from the SSD records a store opens with.

Records of the format before block ids (keyed by the 32-byte block key, the namespace only
in the header) are first moved under their block id, all in one transaction, so a crash
midway leaves the old format whole to migrate again.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kvstore.keys import KEY_BYTES
from kvstore.store import chains
from kvstore.store.index import BlockIndex, BlockState, Entry, block_id, split_block_id
from kvstore.store.tiering.ssd_space import SsdSpace
from kvstore.store.tiers.base import RecordHeader

log = logging.getLogger(__name__)


class Recovered(NamedTuple):
    num_blocks: int  # indexed from their records
    num_bad: int  # malformed records, deleted
    last_seq: int  # the highest commit order recovered (0 for none)


def recover_index(index: BlockIndex, space: SsdSpace) -> Recovered:
    """Indexes every well-formed record of `space`'s SSD, oldest first, as an SSD block."""
    ssd = space.ssd
    good: dict[bytes, RecordHeader] = {}
    legacy: dict[bytes, tuple[bytes, RecordHeader]] = {}  # block id -> (old key, header)
    bad: list[bytes] = []
    for key, header in ssd.scan():
        if header is not None and len(key) == KEY_BYTES:
            legacy[block_id(header.namespace_id, key)] = (key, header)
        elif header is not None and split_block_id(key)[0] == header.namespace_id:
            good[key] = header
        else:
            bad.append(key)
    _migrate(space, good, legacy)
    for bid, header in sorted(good.items(), key=lambda item: item[1].seq):
        _recover_entry(index, space, bid, header)
    if bad:
        ssd.write([], delete=bad)
    last_seq = max((h.seq for h in good.values()), default=0)
    return Recovered(len(good), len(bad), last_seq)


def _migrate(
    space: SsdSpace,
    good: dict[bytes, RecordHeader],
    legacy: dict[bytes, tuple[bytes, RecordHeader]],
) -> None:
    """Re-keys old-format records by block id (into `good`); one already there wins."""
    if not legacy:
        return
    duplicates = [key for bid, (key, _) in legacy.items() if bid in good]
    moves = [(key, bid) for bid, (key, _) in legacy.items() if bid not in good]
    space.ssd.rekey(moves, delete=duplicates)
    good.update((bid, header) for bid, (_, header) in legacy.items() if bid not in good)
    log.info("event=ssd_migrated records=%d duplicates=%d", len(moves), len(duplicates))


def _recover_entry(index: BlockIndex, space: SsdSpace, bid: bytes, h: RecordHeader) -> None:
    namespace_id, key = split_block_id(bid)
    parent = h.parent
    if parent is not None and chains.closes_cycle_on_return(
        index, bid, block_id(namespace_id, parent)
    ):
        log.warning("event=ssd_cycle_cut key=%s", key.hex()[:16])
        parent = None  # written before chains were checked: recovered as a root
    entry = Entry(key, namespace_id, parent, h.nbytes, None, BlockState.COMMITTED)
    entry.checksum, entry.seq = h.checksum, h.seq
    index.add(entry)
    space.track(entry)
