"""The frequency-aware policies: exact victim orders after each mutation."""

from __future__ import annotations

import pytest

from bench.trace_file import hit_ratio
from bench.trace_gen import generate
from bench.trace_sim import simulate_lru, simulate_policy
from kvstore.policy import POLICIES, BlockHint, LRUPolicy, Prefix2QPolicy, make_policy, prompt_class


def _chain(policy: Prefix2QPolicy, keys: bytes) -> None:
    """Inserts the one-byte keys of `keys` as one chain, root first, none of them read."""
    for i, key in enumerate(keys):
        policy.insert(bytes([key]), bytes([keys[i - 1]]) if i else None)


def _keys(keys: bytes) -> list[bytes]:
    return [bytes([key]) for key in keys]


def _dead_ends_do_not_come_back(policy: Prefix2QPolicy) -> None:
    """Teaches `policy` that dead ends are evicted for good: one is, and never returns."""
    policy.insert(b"\xff", None)
    policy.remove(b"\xff")
    assert policy.near_end_distances() == [0]


def test_prefix_2q_is_registered() -> None:
    assert POLICIES["prefix-2q"] is Prefix2QPolicy
    assert isinstance(make_policy("prefix-2q"), Prefix2QPolicy)


def test_distances_to_the_end_of_unread_chains() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abcde")
    _chain(policy, b"xy")
    # Capped at NEAR_END_BLOCKS = 3 ("farther").
    assert policy._distance == dict(zip(_keys(b"edcbayx"), [0, 1, 2, 3, 3, 0, 1], strict=True))
    policy.touch(_keys(b"xy"))  # read: no longer unread
    assert b"x" not in policy._distance and b"y" not in policy._distance


def test_without_evidence_probation_is_oldest_first() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    assert policy.near_end_distances() == []
    assert list(policy.candidates()) == [b"c", b"d"]  # a and b have a stored child
    assert all(policy.should_demote(k) for k in _keys(b"abcd"))


def test_dead_ends_that_do_not_come_back_go_first_and_are_not_demoted() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"d")
    _chain(policy, b"abc")
    _dead_ends_do_not_come_back(policy)
    assert list(policy.candidates()) == [b"d", b"c"]  # both dead ends, oldest first
    assert [policy.should_demote(k) for k in _keys(b"abcd")] == [True, True, False, False]
    _chain(policy, b"pqrs")  # s (0), r (1): only distance 0 goes first
    assert list(policy.candidates()) == [b"d", b"c", b"s"]


def test_near_ends_go_first_the_closest_to_the_end_first() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abcdef")
    _chain(policy, b"xyz")
    for key in b"fze":  # f, z (0), then e (1) are evicted and never come back
        policy.remove(bytes([key]))
    assert policy.near_end_distances() == [0, 1]
    # y (1) first; then d, a tail now but 2 from the end it had (distances never shrink).
    assert list(policy.candidates()) == [b"y", b"d"]
    policy.remove(b"y")
    policy.remove(b"d")
    assert policy.near_end_distances() == [0, 1, 2]  # distance 2 is near now too
    assert list(policy.candidates()) == [b"x", b"c"]
    assert policy._distance == {b"a": 3, b"b": 3, b"c": 3, b"x": 2}


def test_a_distance_whose_blocks_come_back_is_not_a_near_end() -> None:
    policy = Prefix2QPolicy()
    _dead_ends_do_not_come_back(policy)
    _chain(policy, b"abc")
    policy.remove(b"c")  # a dead end, gone...
    policy.insert(b"c", b"b")  # ...back from the ghost list: dead ends do come back
    assert policy.near_end_distances() == []
    _chain(policy, b"xyz")
    assert list(policy.candidates()) == [b"z", b"c"]  # oldest first: c is protected


def test_old_evidence_fades_as_the_workload_changes() -> None:
    policy = Prefix2QPolicy()
    for i in range(200):  # 200 dead ends evicted for good
        policy.insert(i.to_bytes(2), None)
        policy.remove(i.to_bytes(2))
    assert policy.near_end_distances() == [0]
    for i in range(1000, 1060):  # then 60 dead ends read
        policy.insert(i.to_bytes(2), None)
        policy.touch([i.to_bytes(2)])
    # 60 of 260 would keep dead ends first; halved every 64 outcomes, the 200 weigh less.
    assert policy.near_end_distances() == []


def test_a_hit_protects_and_a_tail_becomes_a_candidate_after_its_child_goes() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    policy.touch(_keys(b"ab"))  # a and b used twice: protected; c, d stay on probation
    assert list(policy.candidates()) == [b"c", b"d"]
    policy.remove(b"c")
    # probation holds d, 1 of 3 blocks (> 25%), then protected: b (a has a child).
    assert list(policy.candidates()) == [b"d", b"b"]
    assert len(policy) == 3


def test_a_block_back_from_the_ghost_list_is_protected() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    policy.touch(_keys(b"ab"))
    policy.remove(b"c")  # from probation: remembered in the ghost list
    policy.insert(b"c", b"b")  # used again: protected, tail-first order a, c, b
    assert policy.should_demote(b"c")
    # probation (d) is 1 of 4 blocks (<= 25%): it gives the first victim, then protected
    # (a and b have children).
    assert list(policy.candidates()) == [b"d", b"c"]
    policy.remove(b"d")
    assert list(policy.candidates()) == [b"c"]


def test_ghost_list_is_bounded_and_remove_is_idempotent() -> None:
    policy = Prefix2QPolicy()
    for i in range(10):
        policy.insert(bytes([i]), None)
    for i in range(9):
        policy.remove(bytes([i]))
    policy.remove(b"unknown")
    assert len(policy) == 1
    assert len(policy._ghost) == 2  # GHOST_FACTOR * one tracked block
    policy.insert(bytes([8]), None)  # still remembered: protected
    policy.insert(bytes([0]), None)  # forgotten: probation
    assert list(policy.candidates()) == [bytes([9]), bytes([0]), bytes([8])]


def test_protected_overflow_gets_a_second_chance_on_probation() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"fg")
    policy.remove(b"g")  # f: on probation, a tail, 1 from the end (distances never shrink)
    for key in b"abcd":
        policy.insert(bytes([key]), None)
    policy.touch([b"a"])
    policy.touch([b"b"])
    policy.touch([b"c"])  # 3 of 4 dead ends came back: none goes first
    assert policy.near_end_distances() == []
    assert list(policy.candidates()) == [b"f", b"d", b"a", b"b", b"c"]  # 3 of 5 protected
    policy.touch([b"d"])  # 4 of 5 protected is over 75%
    # The least recent, a, goes back to probation's young end, where victims come from,
    # oldest first: a outlives f, used once before it.
    assert list(policy.candidates()) == [b"f", b"a", b"b", b"c", b"d"]
    assert list(policy._probation) == [b"f", b"a"]
    policy.touch([b"a"])  # a hit on probation protects again; b overflows in turn
    assert list(policy.candidates()) == [b"f", b"b", b"c", b"d", b"a"]


def test_a_block_moved_from_another_tier_is_never_a_near_end() -> None:
    policy = Prefix2QPolicy()
    _dead_ends_do_not_come_back(policy)
    policy.insert(b"c", b"b", moved=True)  # chain victims arrive tail first
    policy.insert(b"b", b"a", moved=True)
    policy.insert(b"x", None)  # born here, never extended: a dead end
    assert policy._distance == {b"x": 0}
    assert list(policy.candidates()) == [b"x", b"c"]  # then probation, oldest tail first


def _roots(policy: Prefix2QPolicy, keys: bytes) -> None:
    for key in keys:
        policy.insert(bytes([key]), None)


def test_a_block_back_soon_after_its_eviction_unread_grows_probation() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"abcd")
    for key in _keys(b"abc"):
        policy.touch([key])  # protected: a, b, c, least recent first
    policy.remove(b"d")  # evicted unread...
    policy.insert(b"d", None)  # ...and back before 3 (protected's size) more evictions
    # One block of three more for probation (0.25 + 1/3), so protected keeps 1.67 of 4.
    assert policy._probation_share == 0.25 + 1 / 3
    list(policy.candidates())
    assert list(policy._probation) == _keys(b"abc")  # with 0.25, only a would have moved


def test_a_second_chance_back_soon_after_its_eviction_grows_protected() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"abcde")
    for key in _keys(b"abcd"):
        policy.touch([key])  # 4 of 5 protected: over 75%
    list(policy.candidates())
    assert list(policy._probation) == [b"e", b"a"]  # a: a second chance
    policy.remove(b"a")
    policy.insert(b"a", None)  # back before 2 (probation's size) more evictions
    assert policy._probation_share == Prefix2QPolicy.MIN_PROBATION  # 0.25 - 1/4, bounded


def test_a_block_back_too_late_for_any_share_changes_nothing() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"ab")
    policy.touch([b"a"])  # protected holds 1
    policy.remove(b"b")
    policy.insert(b"c", None)
    policy.remove(b"c")
    policy.insert(b"b", None)  # 1 eviction after its own: no longer within protected's size
    assert policy._probation_share == Prefix2QPolicy.PROBATION_FRACTION
    assert b"b" in policy._protected  # still admitted as reused


@pytest.mark.parametrize(
    ("kind", "capacities"), [("conversation", (1500, 3000)), ("agent", (600,))]
)
def test_no_worse_than_lru_on_generated_multi_turn_traces(kind: str, capacities) -> None:
    """A conversation's next turn comes after a fixed 25% probation has let its blocks go;
    the adapted share keeps them (a fixed share gives 0.9988x LRU at 3,000 here)."""
    requests = generate(kind, 600, seed=0)
    for capacity in capacities:
        lru = hit_ratio(requests, simulate_lru(requests, capacity), "tokens")
        ours = hit_ratio(requests, simulate_policy(requests, capacity, "prefix-2q"), "tokens")
        assert ours >= lru, (kind, capacity)


def test_prompt_classes_double() -> None:
    lengths = (1, 3, 4, 7, 8, 16, 32, 63, 64, 10_000)
    assert [prompt_class(n) for n in lengths] == [0, 0, 1, 1, 2, 3, 4, 4, 5, 5]


def test_an_unread_block_is_in_the_class_of_the_prompt_that_wrote_it() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    assert policy._prompt_class == dict.fromkeys(_keys(b"abc"), 0)  # a 3-block prompt
    policy.touch(_keys(b"abc"))  # read: no longer unread
    for i, key in enumerate(b"defgh"):  # a prompt of 8 blocks extends the read prefix abc
        policy.insert(bytes([key]), bytes([b"cdefg"[i]]))
        # each new block raises its unread ancestors' class, never a read one's
        assert set(policy._prompt_class.values()) == {prompt_class(4 + i)}
    assert policy._prompt_class == dict.fromkeys(_keys(b"defgh"), 2)


def _prompts(policy: Prefix2QPolicy, num_prompts: int, blocks: int, seed: int) -> list[list[bytes]]:
    """Inserts `num_prompts` unread prompts of `blocks` blocks each; returns their keys."""
    prompts = []
    for p in range(num_prompts):
        keys = [(seed * 10_000 + p * 100 + i).to_bytes(4) for i in range(blocks)]
        for i, key in enumerate(keys):
            policy.insert(key, keys[i - 1] if i else None)
        prompts.append(keys)
    return prompts


def test_prompt_classes_come_back_as_measured() -> None:
    policy = Prefix2QPolicy()
    assert policy.waiting_speeds() == [1.0] * 7  # no evidence: order of arrival
    for keys in _prompts(policy, 8, 2, seed=1):  # short prompts (class 0) go for good
        for key in reversed(keys):
            policy.remove(key)
    speeds = policy.waiting_speeds()
    assert speeds[0] > 50 and speeds[1:] == [1.0] * 6  # (0.5 / (1 / 18)) ** 2 = 81
    for keys in _prompts(policy, 4, 8, seed=2):  # prompts of 8 blocks (class 2) are read
        policy.touch(keys)
    speeds = policy.waiting_speeds()
    assert speeds[2] == 1.0 and speeds[6] == 1.0  # the best class, and blocks of none
    assert speeds[0] > speeds[1] > 1.0  # classes without evidence wait faster than it
    before = policy._prompt_returns.rate(0)
    short = _prompts(policy, 1, 2, seed=3)[0]
    policy.remove(short[1])
    assert policy._prompt_returns.rate(0) < before
    policy.insert(short[1], short[0])  # back from the ghost list: it came back after all
    assert policy._prompt_returns.rate(0) > before


def test_a_block_of_a_class_that_comes_back_less_often_waits_faster() -> None:
    def first_victims(evidence: bool) -> list[str]:
        policy = Prefix2QPolicy()
        for _ in range(20 if evidence else 0):  # short prompts never come back, long ones do
            policy._prompt_returns.record(0, False, len(policy))
            policy._prompt_returns.record(2, True, len(policy))
        prompts = {
            name: _prompts(policy, 1, n, seed=n)[0]
            for name, n in [("long", 8), ("short", 2), ("later", 9)]
        }
        tails = {keys[-1]: name for name, keys in prompts.items()}
        return [tails[k] for k in list(policy.candidates())[:3]]

    # The short prompt waited 9 blocks, the long one 11: with the evidence, the short one's
    # tail goes first (9 * (0.95 / 0.045) ** 2 > 11); without it, the oldest.
    assert first_victims(evidence=True) == ["short", "long", "later"]
    assert first_victims(evidence=False) == ["long", "short", "later"]


def test_the_prompt_class_follows_a_demoted_block_to_the_tier_below() -> None:
    dram, ssd = Prefix2QPolicy(), Prefix2QPolicy()
    _chain(dram, b"abcd")  # a prompt of 4 blocks: class 1
    dram.touch([b"a"])
    assert [dram.hint(k) for k in _keys(b"abcd")] == [
        None,
        BlockHint(1),
        BlockHint(1),
        BlockHint(1),
    ]
    ssd.insert(b"d", b"c", moved=True, hint=dram.hint(b"d"))
    ssd.insert(b"c", b"b", moved=True)  # no hint: no class
    assert ssd._prompt_class == {b"d": 1}
    ssd.remove(b"d")  # evicted unread: counted against its class on SSD
    assert ssd._prompt_returns.rate(1) < 0.5
    lru = LRUPolicy()
    lru.insert(b"d", b"c", moved=True, hint=BlockHint(1))  # other policies ignore hints
    assert lru.hint(b"d") is None and list(lru.candidates()) == [b"d"]
