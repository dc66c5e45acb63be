"""Keys a policy evicted, remembered for a while without their bytes."""

from __future__ import annotations

from collections import OrderedDict


class GhostList:
    """Evicted keys, oldest first, at most `limit` of them as of the last `add`."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes, limit: float) -> None:
        """Remembers an evicted key, then forgets the oldest beyond `limit` keys."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > limit:
            self._keys.popitem(last=False)

    def pop(self, key: bytes) -> bool:
        """Forgets `key`; whether it was remembered."""
        return self._keys.pop(key, 0) is None

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
