"""The block index: block id -> entry (tier, slot, size, checksum, state, leases); prefix match.

A block is identified by its namespace and its key together: its *block id* is
`namespace_id + key` (64 bytes). The index, the policies, the HBM copies and the SSD records
all go by block id, so the same key in two namespaces is two unrelated blocks, and nothing
about one namespace's blocks shows through another's.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.keys import CHAIN_GROUP_BLOCKS, KEY_BYTES
from kvstore.store.inventory import Inventory
from kvstore.store.tiers.base import Slot

BLOCK_ID_BYTES = 2 * KEY_BYTES


def block_id(namespace_id: bytes, key: bytes) -> bytes:
    """The store-wide identity of block `key` of namespace `namespace_id`."""
    return namespace_id + key


def split_block_id(bid: bytes) -> tuple[bytes, bytes]:
    """`(namespace_id, key)` of a block id; empty parts for something of the wrong size."""
    if len(bid) != BLOCK_ID_BYTES:
        return b"", b""
    return bid[:KEY_BYTES], bid[KEY_BYTES:]


class BlockState(enum.Enum):
    RESERVED = "reserved"  # slot allocated, bytes being written; invisible to readers
    COMMITTED = "committed"  # readable


@dataclass
class Entry:
    """One block. Mutated only by the store, under its lock.

    A committed block lives in DRAM (`slot`), on SSD (`on_ssd`) or both: SSD keeps its copy
    when a block is promoted, so evicting a block that is on SSD from DRAM costs no write.
    A DRAM block may also have a device copy in HBM (`hbm_slot`).
    """

    key: bytes
    namespace_id: bytes
    parent: bytes | None
    nbytes: int
    slot: Slot | None
    state: BlockState = BlockState.RESERVED
    checksum: int = 0
    num_leases: int = 0  # readers, and the demoter while it writes the block out
    on_ssd: bool = False
    seq: int = 0  # commit order
    is_demoting: bool = False  # being written to SSD outside the lock; out of the DRAM policy
    num_hits: int = 0  # reads since commit, in any tier
    hbm_slot: Slot | None = None  # device copy of the DRAM block (HBM is inclusive of DRAM)
    depth: int = -1  # its place in its chain (a root is 0); -1 where a link is unknown
    group: bytes | None = None  # first key of its run of CHAIN_GROUP_BLOCKS; None: unknown
    block_id: bytes = field(init=False)  # namespace_id + key: what index and policies use
    parent_id: bytes | None = field(init=False)  # the parent's block id

    def __post_init__(self) -> None:
        self.block_id = block_id(self.namespace_id, self.key)
        self.parent_id = None if self.parent is None else block_id(self.namespace_id, self.parent)

    @property
    def tier(self) -> str:
        """The fastest tier holding the block."""
        if self.hbm_slot is not None:
            return "hbm"
        return "dram" if self.slot is not None else "ssd"

    @property
    def is_readable(self) -> bool:
        return self.state is BlockState.COMMITTED

    @property
    def is_evictable(self) -> bool:
        return self.state is BlockState.COMMITTED and self.num_leases == 0


class BlockIndex:
    """All entries of one store node, reserved and committed, by block id. With an
    `inventory`, every change a mirror of the node's blocks must see is noted there."""

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._num_children: dict[bytes, int] = {}  # block id -> entries naming it as parent
        self.inventory: Inventory[Entry] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, bid: bytes) -> bool:
        return bid in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def get(self, bid: bytes) -> Entry | None:
        return self._entries.get(bid)

    def add(self, entry: Entry) -> None:
        assert entry.block_id not in self._entries, "block already indexed"
        self._entries[entry.block_id] = entry
        self._link(entry, None if entry.parent_id is None else self._entries.get(entry.parent_id))
        if entry.parent_id is not None:
            self._num_children[entry.parent_id] = self._num_children.get(entry.parent_id, 0) + 1

    def pop(self, bid: bytes) -> Entry:
        entry = self._entries.pop(bid)
        self.note(entry)
        if entry.parent_id is not None:
            num_left = self._num_children[entry.parent_id] - 1
            if num_left:
                self._num_children[entry.parent_id] = num_left
            else:
                del self._num_children[entry.parent_id]
        return entry

    def note(self, entry: Entry) -> None:
        """`entry` was committed, dropped or moved between DRAM and SSD."""
        if self.inventory is not None:
            self.inventory.note(entry)

    def link_depths(self) -> None:
        """Places every entry whose parent was indexed after it in its chain (recovery adds
        blocks in commit order, and a call's blocks commit together)."""
        for entry in self._entries.values():
            path: list[Entry] = []  # entries not placed yet, walking up
            node: Entry | None = entry
            while node is not None and node.depth < 0 and node.parent_id is not None:
                path.append(node)
                node = self._entries.get(node.parent_id)
            if node is not None and node.depth < 0:  # a root not placed yet
                self._link(node, None)
            for below in reversed(path):
                self._link(below, node)
                node = below

    def _link(self, entry: Entry, parent: Entry | None) -> None:
        """Places `entry` under `parent` (None: a root, or a parent not indexed)."""
        if parent is not None and parent.depth >= 0:
            entry.depth = parent.depth + 1
            entry.group = entry.key if entry.depth % CHAIN_GROUP_BLOCKS == 0 else parent.group
        elif entry.depth >= 0 and entry.group is not None:
            pass  # the place its writer stated (its parent is held on another node)
        elif entry.parent_id is None:
            entry.depth, entry.group = 0, entry.key
        else:
            entry.depth, entry.group = -1, None

    def is_named_parent(self, bid: bytes) -> bool:
        """Whether an indexed entry names block `bid` as its parent (present or not)."""
        return bid in self._num_children

    def readable(self, namespace_id: bytes, key: bytes) -> Entry | None:
        """The committed entry for `key` in `namespace_id`, or None."""
        entry = self._entries.get(block_id(namespace_id, key))
        if entry is None or not entry.is_readable:
            return None
        return entry

    def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> list[Entry]:
        """Committed entries of the longest present prefix of `keys`."""
        hits = []
        for key in keys:
            entry = self.readable(namespace_id, key)
            if entry is None:
                break
            hits.append(entry)
        return hits
