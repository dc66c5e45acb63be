"""The `keys` benchmark suite through the CLI: rows and fields, no timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.__main__ import build_parser, main
from kvstore.bench.suites import SUITES
from tests.conftest import require_extra

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FIELDS = {
    "block_tokens",
    "input",
    "prompt_tokens",
    "num_blocks",
    "repeats",
    "median_ms",
    "p90_ms",
    "blocks_per_s",
    "x_floor",
    "target_ms",
    "meets_target",
}
EXPECTED_CASES = [(bt, kind) for bt in (16, 64, 256, 512) for kind in ("list", "numpy")]


def _check_rows(rows: list[dict[str, object]]) -> None:
    assert [(r["block_tokens"], r["input"]) for r in rows] == EXPECTED_CASES
    for row in rows:
        assert set(row) == EXPECTED_FIELDS
        assert row["prompt_tokens"] == 131_072
        assert row["num_blocks"] == 131_072 // row["block_tokens"]  # type: ignore[operator]
        assert row["repeats"] == 3
        assert row["target_ms"] == 5.0
        assert isinstance(row["meets_target"], bool)
        assert row["meets_target"] == (row["median_ms"] <= 5.0)  # type: ignore[operator]
        for field in ("median_ms", "p90_ms", "blocks_per_s", "x_floor"):
            assert isinstance(row[field], float) and row[field] > 0  # type: ignore[operator]


def test_keys_quick_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "keys.json"
    assert main(["keys", "--quick", "--json", str(out)]) == 0
    _check_rows(json.loads(out.read_text()))
    assert "meets_target" in capsys.readouterr().out


def test_keys_quick_as_module(tmp_path: Path) -> None:
    out = tmp_path / "keys.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "kvstore.bench", "keys", "--quick", "--json", str(out)]
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    _check_rows(json.loads(out.read_text()))


def test_keys_plot_writes_png(tmp_path: Path) -> None:
    require_extra("matplotlib")
    out = tmp_path / "keys.png"
    assert main(["keys", "--quick", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_suite_has_common_flags() -> None:
    parser = build_parser()
    for name, spec in SUITES.items():
        args = parser.parse_args([name, "--quick", "--json", "x.json"])
        assert (args.suite, args.quick, str(args.json)) == (name, True, "x.json")
        assert hasattr(args, "plot") == spec.can_plot


def test_unknown_suite_is_rejected() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-suite"])
    assert exc.value.code == 2
