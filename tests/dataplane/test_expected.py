"""Which tags a node still expects a message under: each connection's request tag, and the
blocks of the requests it has not read yet or is handling (kvstore.dataplane.ucx.expected_tags)."""

from __future__ import annotations

import os

from kvstore.dataplane.frames import MAX_REQUEST_ID, Kind, RequestTags, Tags
from kvstore.dataplane.ucx.expected_tags import WINDOW, ExpectedTags


def _connection(expected: ExpectedTags, client_id: int) -> tuple[Tags, set[int]]:
    tags, handling = Tags(os.urandom(16)), set()
    expected.add(client_id, tags, handling)
    return tags, handling


def _block(tags: Tags, request_id: int, index: int = 0) -> int:
    return RequestTags.of(tags, request_id).block(index)


def test_request_tags_of_live_connections_only():
    expected = ExpectedTags()
    a, _ = _connection(expected, 1)
    b, _ = _connection(expected, 2)
    assert expected.expects(a.request) and expected.expects(b.request)
    assert not expected.expects(Tags(os.urandom(16)).request)
    expected.remove(1)
    assert not expected.expects(a.request)
    assert expected.expects(b.request)
    assert expected.owner(b.request) == 2
    assert expected.owner(a.request) is None


def test_blocks_of_requests_not_read_yet_are_expected_within_the_window():
    expected = ExpectedTags()
    tags, _ = _connection(expected, 1)
    assert expected.expects(_block(tags, 1, 0))
    assert expected.expects(_block(tags, WINDOW, 65535))
    assert not expected.expects(_block(tags, WINDOW + 1))
    expected.read(1, 10)
    assert expected.expects(_block(tags, 10 + WINDOW))
    assert expected.owner(_block(tags, 11)) == 1


def test_blocks_of_a_read_request_are_expected_only_while_it_is_handled():
    expected = ExpectedTags()
    tags, handling = _connection(expected, 1)
    expected.read(1, 5)
    handling.add(5)
    assert expected.expects(_block(tags, 5, 3))
    handling.discard(5)
    assert not expected.expects(_block(tags, 5, 3))  # a finished request takes no more
    assert expected.expects(_block(tags, 6))


def test_ids_sent_out_of_order_are_expected_until_read():
    expected = ExpectedTags()
    tags, _ = _connection(expected, 1)
    expected.read(1, 9)
    assert expected.expects(_block(tags, 8))  # behind the highest read, not read yet
    expected.read(1, 8)  # a ping: read, never handled
    assert not expected.expects(_block(tags, 8))
    assert expected.expects(_block(tags, 7))


def test_other_kinds_and_other_connections_tags_are_not_expected():
    expected = ExpectedTags()
    tags, _ = _connection(expected, 1)
    request_tags = RequestTags.of(tags, 1)
    assert not expected.expects(request_tags.reply)  # the node sends replies, never takes them
    assert not expected.expects(request_tags.done)
    assert not expected.expects((Kind.BLOCK << 60) | (0xABC << 16))
    assert not expected.expects(0)
    assert not expected.expects(_block(Tags(os.urandom(16)), 1))


def test_window_slides_and_forgets_what_falls_behind():
    expected = ExpectedTags()
    tags, handling = _connection(expected, 1)
    handling.add(1)  # a request still handled once far behind: its receives are posted
    for request_id in range(1, 3 * WINDOW):
        expected.read(1, request_id)
    assert not expected.expects(_block(tags, 1))
    assert expected.expects(_block(tags, 3 * WINDOW - 1 + WINDOW))
    assert not expected.expects(_block(tags, 3 * WINDOW + WINDOW))
    assert expected.num_block_bases == 2 * WINDOW  # bounded per connection


def test_a_jump_to_the_largest_request_id_stays_bounded():
    expected = ExpectedTags()
    tags, _ = _connection(expected, 1)
    expected.read(1, MAX_REQUEST_ID)
    assert not expected.expects(_block(tags, 1))
    assert not expected.expects(_block(tags, MAX_REQUEST_ID))  # read, not handled
    assert expected.num_block_bases == WINDOW
    expected.read(1, 3)  # ids only move up: an old id changes nothing
    assert expected.num_block_bases == WINDOW


def test_removing_a_connection_forgets_all_its_tags():
    expected = ExpectedTags()
    tags, _ = _connection(expected, 1)
    other, _ = _connection(expected, 2)
    expected.read(1, 7)
    expected.remove(1)
    expected.remove(1)  # twice: nothing more
    assert not any(expected.expects(_block(tags, i)) for i in range(1, 8 + WINDOW))
    assert expected.expects(_block(other, 1))
    assert expected.num_block_bases == WINDOW
