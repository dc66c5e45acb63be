"""The quotas file: what it accepts, and a clear error naming the line for what it does not."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgumentError
from kvstore.store.quotas import TenantQuotas


def _load(tmp_path, text: str) -> TenantQuotas:
    path = tmp_path / "quotas"
    path.write_text(text)
    return TenantQuotas.load(path)


def test_quotas_parse_units_and_the_default_line(tmp_path):
    quotas = _load(tmp_path, "# per tenant\nteam-a dram=4MiB ssd=1GiB\n* dram=1MiB\n")
    assert quotas.quota("team-a", "dram") == 4 << 20
    assert quotas.quota("team-a", "ssd") == 1 << 30
    assert quotas.quota("team-b", "dram") == 1 << 20


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("team-a\n", "quotas:1: expected 'TENANT dram=SIZE ssd=SIZE'"),
        ("team-a hbm=1GiB\n", "quotas:1: 'hbm=1GiB' is not one of"),
        ("team-a dram=lots\n", "quotas:1: dram: "),
        ("team-a dram=1MiB\nteam-a ssd=1MiB\n", "quotas:2: team-a is listed twice"),
        ("team/a dram=1MiB\n", "quotas:1: expected 'TENANT"),
    ],
)
def test_a_bad_line_is_refused_naming_it(tmp_path, text, message):
    with pytest.raises(InvalidArgumentError, match=message):
        _load(tmp_path, text)


def test_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(InvalidArgumentError, match="cannot read the quotas file"):
        TenantQuotas.load(tmp_path / "absent")
