"""The eviction policy contract (`EvictionPolicy`) and the opaque hint between tiers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence


class BlockHint:
    """What a tier's policy knew of a block it gives up to the tier below, for that tier's
    policy (`EvictionPolicy.hint`, then `insert(..., hint=...)`).

    Opaque to everything but the policies: the tiering passes it through unread. A policy
    that has something to pass subclasses it, and ignores hints of any other class.
    """

    __slots__ = ()


class EvictionPolicy(ABC):
    """Orders one tier's blocks for eviction. Sees keys and chain links only, never bytes,
    tiers or leases; the store skips candidates it may not evict (leased, reserved).

    Contract: `insert` is called once per committed key, `remove` once when it leaves the
    tier (evicted or removed), `touch` on every hit. Only these three change the policy,
    and only its own state. Everything else (`candidates`, `should_demote`, `hint`,
    `__len__`, `check`) changes nothing, so it can be called any number of times, in any
    order, between mutations. `candidates` is a lazy view: it must not be advanced after
    the policy is mutated; the store takes one victim, evicts it, then asks again.
    """

    @abstractmethod
    def insert(
        self, key: bytes, parent: bytes | None, moved: bool = False, hint: BlockHint | None = None
    ) -> None:
        """Starts tracking `key`, whose chain predecessor is `parent` (None for a root).

        `moved`: the block comes from another tier, so it is not new to the store: demoted
        from the tier above, which judged it worth keeping (`should_demote`), promoted from
        the tier below or copied up after a read, or recovered from disk. `hint`: what the
        tier above's policy knew of a demoted block (`hint`), if anything. `key` is not
        tracked: the store inserts a key once per stay in the tier.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Records a hit on `keys`, given in chain order (root first); ignores unknown keys.
        Changes the order of candidates, never which keys are tracked."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Stops tracking `key`; a no-op for unknown keys."""

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Tracked keys, best victim first, each at most once; changes nothing."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are tracked."""

    @abstractmethod
    def check(self) -> None:
        """Asserts every invariant of the policy's state (AssertionError naming the first
        broken one); changes nothing. For tests, after each mutation."""

    def should_demote(self, key: bytes) -> bool:
        """Whether a victim of this (upper) tier is worth a write to the tier below.

        The tiered decision: True demotes the block, False drops it. Called with the key
        still tracked, just before the store evicts it; changes nothing.
        """
        return True

    def hint(self, key: bytes) -> BlockHint | None:
        """What this (upper) tier knows of `key` that the tier below's policy can use when
        the block is demoted; called with the key still tracked; changes nothing."""
        return None
