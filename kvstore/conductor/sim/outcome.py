"""What happened to each request of a simulation, and the figures a run is compared on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvstore.conductor.decision import RejectReason
from kvstore.conductor.slo import SLO


class RequestOutcome(NamedTuple):
    """One request: rejected (with why), or served with its TTFT, TBT and prefill work.

    A request the policy admitted can still be turned away by the decode instance its KV
    reaches (`late`): it was prefilled, and that work is thrown away.
    """

    request_id: int
    rejected: RejectReason | None
    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    prefilled_tokens: int = 0  # prompt tokens computed, not loaded
    prefill_s: float = 0.0  # seconds its prefill kept an instance busy
    late: bool = False  # rejected after its prefill, by the decode instance

    def is_met(self, slo: SLO) -> bool:
        """Served within both objectives."""
        return self.rejected is None and slo.is_met(self.ttft_s, self.tbt_s)

    @property
    def admitted(self) -> bool:
        """Whether the policy admitted it (it was prefilled), whatever came after."""
        return self.rejected is None or self.late


class SimSummary(NamedTuple):
    """The figures of one run (one policy, one speedup)."""

    requests: int
    slo_attainment: float  # met / all requests
    accepted_slo_attainment: float  # met / accepted
    goodput_rps: float  # met per second of the replayed arrival window
    rejected: int  # by the policy on arrival, or by decode after the prefill
    rejected_late: int  # of those, by decode after the prefill
    wasted_prefill_tokens: int  # prefilled for requests that then missed the SLO
    wasted_prefill_gpu_s: float  # GPU-seconds of prefill those requests took
    ttft_p50_s: float
    ttft_p90_s: float
    tbt_p90_ms: float
    decode_load_std: float  # std over time of the mean decode load (`LoadSample`)
    decode_load_mean: float  # its mean over time (1.0: every instance at its limit)
    prefill_load_mean: float  # the mean prefill load's, likewise


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(
    outcomes: Sequence[RequestOutcome],
    slo: SLO,
    window_s: float,
    decode_load: Sequence[float],
    gpus_per_instance: int = 1,
    prefill_load: Sequence[float] = (),
) -> SimSummary:
    """The figures of a run whose arrivals spanned `window_s` seconds; `decode_load` and
    `prefill_load` are the mean loads sampled at regular times over that window; a prefill
    instance has `gpus_per_instance` GPUs."""
    admitted = [o for o in outcomes if o.admitted]
    served = [o for o in outcomes if o.rejected is None]
    met = sum(o.is_met(slo) for o in outcomes)
    missed = [o for o in admitted if not o.is_met(slo)]
    tbts = [o.tbt_s for o in served if o.tbt_s == o.tbt_s]
    return SimSummary(
        requests=len(outcomes),
        slo_attainment=met / len(outcomes) if outcomes else 0.0,
        accepted_slo_attainment=met / len(admitted) if admitted else 0.0,
        goodput_rps=met / window_s if window_s > 0 else 0.0,
        rejected=len(outcomes) - len(served),
        rejected_late=len(admitted) - len(served),
        wasted_prefill_tokens=sum(o.prefilled_tokens for o in missed),
        wasted_prefill_gpu_s=gpus_per_instance * sum(o.prefill_s for o in missed),
        ttft_p50_s=_pct([o.ttft_s for o in served], 50),
        ttft_p90_s=_pct([o.ttft_s for o in served], 90),
        tbt_p90_ms=1000 * _pct(tbts, 90),
        decode_load_std=float(np.std(decode_load)) if len(decode_load) else 0.0,
        decode_load_mean=float(np.mean(decode_load)) if len(decode_load) else float("nan"),
        prefill_load_mean=float(np.mean(prefill_load)) if len(prefill_load) else float("nan"),
    )
