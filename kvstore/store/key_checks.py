"""Key checks: what every call's keys and parents pass before the store changes anything."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore import errors
from kvstore.keys import KEY_BYTES, ChainPosition


def check_keys(keys: Sequence[bytes], max_batch_keys: int) -> None:
    """Raises unless `keys` are 1 to `max_batch_keys` distinct keys of `KEY_BYTES` bytes."""
    if not keys:
        raise errors.EmptyRequestError("no keys given")
    if len(keys) > max_batch_keys:
        raise errors.BatchTooLargeError(
            f"{len(keys)} keys in one call; the limit is {max_batch_keys}"
        )
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise errors.BadKeyError(f"key {i} has {len(key)} bytes, keys have {KEY_BYTES}")
    if len(set(keys)) != len(keys):
        raise errors.DuplicateKeyError("the same key appears more than once in one call")


def check_parents(
    keys: Sequence[bytes], parents: Sequence[bytes | None] | None
) -> list[bytes | None]:
    """`parents` as a list, one per key (all None when not given), if well formed."""
    if parents is None:
        return [None] * len(keys)
    if len(parents) != len(keys):
        raise errors.InvalidArgumentError(f"{len(parents)} parents for {len(keys)} keys")
    if any(p is not None and len(p) != KEY_BYTES for p in parents):
        raise errors.BadKeyError(f"parent keys must be {KEY_BYTES} bytes")
    return list(parents)


def check_position(
    keys: Sequence[bytes], parents: Sequence[bytes | None], position: ChainPosition | None
) -> None:
    """Raises `InvalidArgumentError` unless `position` (of the first key) is None, or one
    the first key can have after a parent held elsewhere."""
    if position is None:
        return
    if not keys or parents[0] is None:
        raise errors.InvalidArgumentError("a chain position is stated for a first key's parent")
    position.check(keys[0])
