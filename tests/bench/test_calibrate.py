"""`kvstore-bench calibrate`: the fit, and a quick run against the real engine and store."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.bench.calibrate_fit import fit_nonnegative
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.profile import CostProfile


def test_an_exact_linear_form_is_recovered():
    features = [[1.0, n, n * n] for n in (1, 2, 3, 5, 8)]
    times = [0.5 + 0.25 * n + 0.125 * n * n for _, n, _ in features]
    fit = fit_nonnegative(features, times)
    assert fit.coefs == pytest.approx((0.5, 0.25, 0.125))
    assert fit.r2 == pytest.approx(1.0)
    assert fit.median_abs_error == pytest.approx(0.0, abs=1e-9)


def test_a_coefficient_that_noise_makes_negative_is_dropped():
    features = [[1.0, x] for x in (1, 2, 3, 4)]
    times = [2.0, 1.9, 1.8, 1.7]  # shrinks with work: only noise can say that
    fit = fit_nonnegative(features, times)
    assert fit.coefs[1] == 0.0
    assert fit.coefs[0] == pytest.approx(1.85)


def test_too_few_points_is_an_error():
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_nonnegative([[1.0, 2.0, 3.0]], [1.0])


def test_a_quick_calibration_writes_a_profile_the_cost_model_reads(tmp_path):
    out, rows = tmp_path / "profile.json", tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvstore.bench", "calibrate", "--quick", "--model", "tiny"]
    cmd += ["--out", str(out), "--json", str(rows)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    profile = CostProfile.load(out)
    assert profile.block_tokens == 16 and profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert profile.pool_bandwidth_bytes_per_s > 0
    model = CostModel(profile)
    assert model.prefill_s(512, 0) >= model.prefill_s(512, 256) >= 0  # cached work is free
    fits = {row["fit"] for row in json.loads(rows.read_text())}
    assert fits == {"prefill", "decode", "transfer"}
