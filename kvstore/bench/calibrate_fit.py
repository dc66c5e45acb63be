"""Least-squares fits of the cost model's linear forms, with coefficients kept >= 0.

Each form is ``time = sum_i coef_i * feature_i``. A negative coefficient has no physical
meaning (a cost that shrinks with more work) and comes only from noise, so a fit that gives
one drops that feature and fits again: nonnegative least squares for a handful of features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Fit(NamedTuple):
    coefs: tuple[float, ...]  # one per feature, >= 0
    r2: float  # coefficient of determination over the points
    median_abs_error: float  # of relative error, |predicted - measured| / measured

    def predict(self, features: Sequence[float]) -> float:
        return float(np.dot(self.coefs, features))


def fit_nonnegative(features: Sequence[Sequence[float]], times_s: Sequence[float]) -> Fit:
    """Fits `times_s[k] ~ coefs . features[k]` with every coefficient >= 0.

    Raises:
        ValueError: fewer points than features.
    """
    x = np.asarray(features, dtype=float)  # (points, features)
    y = np.asarray(times_s, dtype=float)
    if x.ndim != 2 or len(x) < x.shape[1]:
        raise ValueError(f"need at least {x.shape[-1]} points, got {len(x)}")
    active = list(range(x.shape[1]))
    coefs = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coefs[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # the most negative: noise, not a cost
    predicted = x @ coefs
    ss_res = float(((y - predicted) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(predicted - y) / np.maximum(y, 1e-12)
    return Fit(tuple(float(c) for c in coefs), r2, float(np.median(rel)))
