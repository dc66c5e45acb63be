"""Chain links: which parent a block may name, so that chains never close a cycle.

A block names its chain predecessor (`parent`), and prefix policies evict only chain tails:
a cycle would be blocks that no policy ever evicts. Links are acyclic by construction:

- a key is never its own parent;
- a parent is committed in the block's namespace, or comes earlier in the same reserve
  call (`check_parents`); any other is unknown, and the caller's chain is cut there.

That alone is not enough: a block may leave the store while its children stay, and they
keep naming it, so the policies link them to it again if it comes back. A key that an entry
names as parent therefore comes back only where its own parent chain does not lead back to
it (`closes_cycle`, `closes_cycle_on_return`). Walks are shared within one call, so a call
walks each block once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore import errors
from kvstore.store.index import BlockIndex, block_id


def check_parents(
    index: BlockIndex,
    namespace_id: bytes,
    keys: Sequence[bytes],
    parents: Sequence[bytes | None],
    is_new: Sequence[bool],
    first_parent_elsewhere: bool = False,
) -> None:
    """Raises a `BadParentError` unless every link of a reserve call is allowed.

    `is_new[i]`: whether `keys[i]` will be reserved (the others keep the links they have).
    `first_parent_elsewhere`: the first key's parent is held on another node of a pool,
    so it need not be committed here. Changes nothing.
    """
    earlier: set[bytes] = set()
    for i, (key, parent) in enumerate(zip(keys, parents, strict=True)):
        if parent == key:
            raise errors.ChainCycleError(f"key {i} names itself as its parent")
        is_committed = parent is not None and index.readable(namespace_id, parent) is not None
        is_elsewhere = i == 0 and first_parent_elsewhere
        if parent is not None and parent not in earlier and not is_committed and not is_elsewhere:
            raise errors.UnknownParentError(
                f"the parent of key {i} is neither committed in this namespace nor earlier in "
                "this call (evicted, removed or never stored): the chain is cut there"
            )
        earlier.add(key)
    new_parents = {
        block_id(namespace_id, key): None if parent is None else block_id(namespace_id, parent)
        for key, parent, new in zip(keys, parents, is_new, strict=True)
        if new
    }
    _check_acyclic(index, namespace_id, keys, new_parents)


def _check_acyclic(
    index: BlockIndex,
    namespace_id: bytes,
    keys: Sequence[bytes],
    new_parents: Mapping[bytes, bytes | None],
) -> None:
    # Only a key some entry names as parent can close a cycle: walk up from those.
    done: set[bytes] = set()
    for i, key in enumerate(keys):
        bid = block_id(namespace_id, key)
        is_named = new_parents.get(bid) is not None and index.is_named_parent(bid)
        if is_named and closes_cycle(index, bid, new_parents, done):
            raise errors.ChainCycleError(
                f"key {i}: its parent chain leads back to it (a block below it names it as "
                "its parent)"
            )


def closes_cycle(
    index: BlockIndex,
    start: bytes,
    new_parents: Mapping[bytes, bytes | None],
    done: set[bytes],
) -> bool:
    """Whether following parents up from block `start` comes back to a block already passed.

    `new_parents`: links about to be made (block id -> parent id), which take precedence
    over the index. `done`: blocks whose walk ended without a cycle under the same links;
    a walk stops there, and adds its own blocks when it ends so.
    """
    path: set[bytes] = set()
    node: bytes | None = start
    while node is not None and node not in done:
        if node in path:
            return True
        path.add(node)
        if node in new_parents:
            node = new_parents[node]
        else:
            entry = index.get(node)
            node = None if entry is None else entry.parent_id
    done |= path
    return False


def closes_cycle_on_return(index: BlockIndex, bid: bytes, parent_id: bytes) -> bool:
    """Whether block `bid`, out of the index, would close a cycle coming back under parent
    `parent_id` (an SSD record taken back, or recovered)."""
    if parent_id == bid:
        return True
    if not index.is_named_parent(bid):
        return False
    return closes_cycle(index, bid, {bid: parent_id}, set())
