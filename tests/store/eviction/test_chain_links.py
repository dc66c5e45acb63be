"""Chain links: parents, children and tails among tracked keys, in any arrival order."""

from __future__ import annotations

from kvstore.store.eviction.chain_links import ChainLinks


def _links(*pairs: tuple[bytes, bytes | None]) -> ChainLinks:
    links = ChainLinks()
    for key, parent in pairs:
        links.link(key, parent)
        links.check()
    return links


def test_a_key_with_a_tracked_child_is_no_tail() -> None:
    links = _links((b"a", None), (b"b", b"a"), (b"c", b"b"))
    assert [links.is_tail(k) for k in (b"a", b"b", b"c")] == [False, False, True]
    assert (links.parent(b"c"), links.parent(b"a"), len(links)) == (b"b", None, 3)


def test_a_child_waits_for_its_parent_and_is_adopted() -> None:
    links = _links((b"c", b"b"))
    assert links.parent(b"c") is None and links.is_tail(b"c")
    links.link(b"b", b"a")
    links.check()
    assert links.parent(b"c") == b"b" and not links.is_tail(b"b")


def test_children_of_an_unlinked_key_wait_for_it_to_come_back() -> None:
    links = _links((b"a", None), (b"b", b"a"), (b"c", b"b"))
    links.unlink(b"b")
    links.check()
    assert links.parent(b"c") is None and links.is_tail(b"a")
    assert b"b" not in links and links.keys() == {b"a", b"c"}
    links.link(b"b", b"a")
    links.check()
    assert links.parent(b"c") == b"b" and not links.is_tail(b"b")


def test_nothing_waits_for_a_key_once_its_children_left() -> None:
    links = _links((b"c", b"b"))
    links.unlink(b"c")
    links.check()
    links.link(b"b", None)
    links.check()
    assert links.is_tail(b"b") and links.keys() == {b"b"}
