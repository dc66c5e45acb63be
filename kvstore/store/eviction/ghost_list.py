"""Keys a policy evicted, remembered for a while without their bytes, each with its age."""

from __future__ import annotations

from collections import OrderedDict


class GhostList:
    """Evicted keys, oldest first, at most `limit` of them as of the last `add`. A key's age
    is how many keys were added after it."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, int] = OrderedDict()  # key -> number when added
        self._added = 0

    def add(self, key: bytes, limit: float) -> None:
        """Remembers an evicted key, then forgets the oldest beyond `limit` keys."""
        self._added += 1
        self._keys[key] = self._added
        self._keys.move_to_end(key)
        while len(self._keys) > limit:
            self._keys.popitem(last=False)

    def pop(self, key: bytes) -> int | None:
        """Forgets `key`; its age where it was remembered, else None."""
        added = self._keys.pop(key, None)
        return None if added is None else self._added - added

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
