"""The ghost list: evicted keys, oldest first, bounded at each add, each with its age."""

from __future__ import annotations

from kvstore.store.eviction.ghost_list import GhostList


def test_remembers_the_most_recent_keys_up_to_the_limit() -> None:
    ghost = GhostList()
    for i in range(5):
        ghost.add(bytes([i]), limit=3)
    assert len(ghost) == 3
    assert [bytes([i]) in ghost for i in range(5)] == [False, False, True, True, True]


def test_pop_forgets_and_gives_the_age_of_what_it_remembered() -> None:
    ghost = GhostList()
    for key in (b"a", b"b", b"c"):
        ghost.add(key, limit=3)
    assert (ghost.pop(b"b"), ghost.pop(b"a"), ghost.pop(b"c")) == (1, 2, 0)  # keys added after
    assert ghost.pop(b"a") is None and len(ghost) == 0


def test_adding_a_remembered_key_again_makes_it_the_newest() -> None:
    ghost = GhostList()
    for key in (b"a", b"b", b"a", b"c"):
        ghost.add(key, limit=2)
    assert (b"a" in ghost, b"b" in ghost, b"c" in ghost) == (True, False, True)
