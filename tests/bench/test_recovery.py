"""`kvstore-bench recovery --quick` runs and reports every block recovered."""

from __future__ import annotations

import json

from kvstore.bench.__main__ import main


def test_recovery_bench_recovers_every_block(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["recovery", "--quick", "--json", str(out)]) in (0, None)
    [row] = json.loads(out.read_text())
    assert row["blocks"] == 10_000 and row["recovered"] == 10_000
    assert row["block_bytes"] == 8192
    assert row["recovery_s"] > 0 and row["scan_floor_s"] > 0
