"""How the predicted decode test decided otherwise than the current-batch test, from the
counts `CacheAwarePredictivePolicy` keeps: so a tie with the current-batch test is visibly
a tie by construction (no decision changed) or not."""

from __future__ import annotations

from collections.abc import Mapping


def decisions_changed(counts: Mapping[str, int]) -> dict[str, int | None]:
    """How the predicted decode test decided otherwise than the current-batch test would
    have on the same view: admissions changed (either way), and requests both admit that
    it sends to another decode instance; None for a policy that does not predict."""
    if "decode_tests" not in counts:
        return {"decisions_changed": None, "placed_elsewhere": None}
    changed = counts["admitted_over_current"] + counts["refused_over_current"]
    return {"decisions_changed": changed, "placed_elsewhere": counts["placed_elsewhere"]}
