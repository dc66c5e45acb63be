"""Parent/child links among the keys a policy tracks, and which of them are chain tails."""

from __future__ import annotations


class ChainLinks:
    """Parent/child links among tracked keys; a key none of whose children is stored is a tail.

    Keys may arrive children first (a lower tier receives a chain's victims tail first): a
    child whose parent is not tracked waits for it, and is linked when the parent arrives.
    """

    def __init__(self) -> None:
        self._parent: dict[bytes, bytes] = {}
        self._children: dict[bytes, set[bytes]] = {}  # every tracked key
        self._awaited: dict[bytes, set[bytes]] = {}  # untracked parent -> tracked children
        self._awaits: dict[bytes, bytes] = {}  # tracked child -> its untracked parent

    def link(self, key: bytes, parent: bytes | None) -> None:
        """Tracks `key` under `parent`, and adopts the tracked children that waited for it."""
        self._children.setdefault(key, set())
        if parent is not None and parent in self._children:
            self._parent[key] = parent
            self._children[parent].add(key)
        elif parent is not None:
            self._wait(key, parent)
        for child in self._awaited.pop(key, ()):
            del self._awaits[child]
            self._parent[child] = key
            self._children[key].add(child)

    def unlink(self, key: bytes) -> None:
        """Stops tracking `key`, which must be tracked."""
        # Children of a removed key are unreachable by prefix; they become roots here, and
        # wait for the key in case it comes back.
        for child in self._children.pop(key):
            del self._parent[child]
            self._wait(child, key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._children[parent].discard(key)
        awaited = self._awaits.pop(key, None)
        if awaited is not None:
            self._awaited[awaited].discard(key)
            if not self._awaited[awaited]:
                del self._awaited[awaited]

    def _wait(self, child: bytes, parent: bytes) -> None:
        self._awaits[child] = parent
        self._awaited.setdefault(parent, set()).add(child)

    def __contains__(self, key: bytes) -> bool:
        return key in self._children

    def __len__(self) -> int:
        return len(self._children)

    def keys(self) -> set[bytes]:
        """Every tracked key (a copy)."""
        return set(self._children)

    def is_tail(self, key: bytes) -> bool:
        return not self._children[key]

    def parent(self, key: bytes) -> bytes | None:
        return self._parent.get(key)

    def check(self) -> None:
        """Links agree both ways; only tracked keys wait, each for one untracked parent."""
        for child, parent in self._parent.items():
            assert child in self._children[parent], f"{child!r} missing under its parent"
        for parent, children in self._children.items():
            assert all(self._parent.get(c) == parent for c in children), "one-way link"
        for child, parent in self._awaits.items():
            assert child in self._awaited[parent] and child in self._children, "stray wait"
            assert parent not in self._children, f"{child!r} waits for a tracked parent"
            assert child not in self._parent, f"{child!r} both waits and is linked"
        assert sum(map(len, self._awaited.values())) == len(self._awaits), "waits disagree"
        assert all(self._awaited.values()), "an empty wait list"
