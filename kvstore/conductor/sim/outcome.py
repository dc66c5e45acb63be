"""What happened to each request of a simulation, and the figures a run is compared on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvstore.conductor.decision import RejectReason
from kvstore.conductor.slo import SLO


class RequestOutcome(NamedTuple):
    """One request: rejected (with why), or served with its TTFT, TBT and prefill work."""

    request_id: int
    rejected: RejectReason | None
    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    prefilled_tokens: int = 0  # prompt tokens computed, not loaded

    def is_met(self, slo: SLO) -> bool:
        """Served within both objectives."""
        return self.rejected is None and slo.is_met(self.ttft_s, self.tbt_s)


class SimSummary(NamedTuple):
    """The figures of one run (one policy, one speedup)."""

    requests: int
    slo_attainment: float  # met / all requests
    accepted_slo_attainment: float  # met / accepted
    goodput_rps: float  # met per second of the replayed arrival window
    rejected: int
    wasted_prefill_tokens: int  # prefilled for requests that then missed the SLO
    ttft_p50_s: float
    ttft_p90_s: float
    tbt_p90_ms: float
    decode_load_std: float  # std over time of the mean decode KV utilisation


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(
    outcomes: Sequence[RequestOutcome], slo: SLO, window_s: float, decode_load: Sequence[float]
) -> SimSummary:
    """The figures of a run whose arrivals spanned `window_s` seconds; `decode_load` is the
    mean decode KV utilisation sampled at regular times over that window."""
    served = [o for o in outcomes if o.rejected is None]
    met = sum(o.is_met(slo) for o in outcomes)
    wasted = sum(o.prefilled_tokens for o in served if not o.is_met(slo))
    tbts = [o.tbt_s for o in served if o.tbt_s == o.tbt_s]
    return SimSummary(
        requests=len(outcomes),
        slo_attainment=met / len(outcomes) if outcomes else 0.0,
        accepted_slo_attainment=met / len(served) if served else 0.0,
        goodput_rps=met / window_s if window_s > 0 else 0.0,
        rejected=len(outcomes) - len(served),
        wasted_prefill_tokens=wasted,
        ttft_p50_s=_pct([o.ttft_s for o in served], 50),
        ttft_p90_s=_pct([o.ttft_s for o in served], 90),
        tbt_p90_ms=1000 * _pct(tbts, 90),
        decode_load_std=float(np.std(decode_load)) if len(decode_load) else 0.0,
    )
