"""The token table and the authenticator, in process."""

from __future__ import annotations

import pytest

from kvstore.auth import ANONYMOUS, Authenticator, TokenTable
from kvstore.errors import InvalidArgumentError, UnauthenticatedError

TOKEN_A, TOKEN_B = "a" * 24, "b" * 32


def _table(tmp_path, text: str) -> TokenTable:
    path = tmp_path / "tokens"
    path.write_text(text)
    return TokenTable.load(path)


def test_tokens_map_to_their_tenants(tmp_path):
    table = _table(tmp_path, f"# operator's file\n\nteam-a {TOKEN_A}\nteam-b {TOKEN_B}\n")
    assert table.tenants == {"team-a", "team-b"}
    assert (table.tenant_of(TOKEN_A), table.tenant_of(TOKEN_B)) == ("team-a", "team-b")
    assert table.tenant_of("c" * 24) is None
    assert table.tenant_of(TOKEN_A[:-1]) is None  # a prefix is no token


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("team-a\n", "tokens:1: expected 'TENANT TOKEN'"),
        (f"team-a {TOKEN_A} extra\n", "expected 'TENANT TOKEN'"),
        ("team-a short\n", r"a token needs 16\+ chars"),
        (f"team/a {TOKEN_A}\n", "a tenant is 1-64 of"),
        (f"a {TOKEN_A}\nb {TOKEN_A}\n", "the same token is listed twice"),
        ("# nothing\n", "the token table is empty"),
    ],
)
def test_a_bad_token_file_is_refused_without_echoing_it(tmp_path, text, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        _table(tmp_path, text)
    assert TOKEN_A not in str(info.value) and "short" not in str(info.value)


def test_a_missing_token_file_names_the_path(tmp_path):
    with pytest.raises(InvalidArgumentError, match="cannot read the token file"):
        TokenTable.load(tmp_path / "absent")


def test_the_authenticator_reads_one_bearer_header(tmp_path):
    auth = Authenticator(_table(tmp_path, f"team-a {TOKEN_A}\n"))
    assert auth.tenant([("authorization", f"Bearer {TOKEN_A}")]) == "team-a"
    assert auth.tenant([("authorization", f"bearer {TOKEN_A}")]) == "team-a"
    refused = [
        None,
        [],
        [("authorization", TOKEN_A)],  # no scheme
        [("authorization", f"Basic {TOKEN_A}")],
        [("authorization", f"Bearer {TOKEN_B}")],
        [("authorization", f"Bearer {TOKEN_A}"), ("authorization", f"Bearer {TOKEN_A}")],
        [("authorization", f"Bearer {TOKEN_A}".encode())],
    ]
    for metadata in refused:
        with pytest.raises(UnauthenticatedError):
            auth.tenant(metadata)


def test_without_a_table_every_call_is_anonymous():
    assert Authenticator(None).tenant(None) == ANONYMOUS
    assert not Authenticator(None).is_enabled
