"""`kvstore-bench scheduler --live`: the trace replayed through `kvstore conductor` over real
engine processes, one row per policy with the simulated run's columns plus the error of the
predicted TTFT against the measured one.

Deployment: a store node, 2 prefill engines and 1 decode engine (`--live-model`, tiny by
default) as processes on this machine, and per policy a fresh conductor in this process
(`ConductorServer`, its HTTP API on a free port) with a fresh policy and view; requests are
sent as OpenAI streaming completions at their (scaled) arrival times, open loop.

Profile: `--profile PATH` (a `kvstore-bench calibrate` file for the same model), else the
model is calibrated here first (`kvstore.bench.calibrate`, quick), so predictions are of this
machine's engine and store. Engines get that calibration's KV pages, so the profile's
capacities are theirs.

Scaling the trace to what the tiny model can run: each trace block (512 tokens, one hash id)
becomes one engine block of `block_tokens` (16) tokens, drawn from a generator seeded by
(the run, the hash id), so requests that share hash-id prefixes share token prefixes, and
every policy's run draws its own tokens (no run finds another's blocks cached). A prompt is
its input length scaled by the same factor (at most `MAX_PROMPT_TOKENS`), an output its
length / `OUTPUT_SCALE` (1..`MAX_OUTPUT_TOKENS`); arrivals are the trace's, `--speedup`
times faster (default `LIVE_SPEEDUP`: the conductor's engines overloaded on this machine).

Columns as the simulator's (`kvstore.conductor.sim.outcome.summarize`), with TTFT measured at
the conductor (arrival to first token out), TBT the mean gap after the first token, and
decode load the mean decode KV utilisation in the conductor's view sampled every
`SAMPLE_S`; then `ttft_pred_err_p50_s`/`_p90_s` (|predicted - measured|),
`ttft_pred_rel_err_p50` (the same over measured) and `ttft_pred_bias_s` (mean predicted -
measured) over served requests; `unrecorded`, requests sent that the conductor turned away
before its policy saw them (none in a valid run: each counts against the verdict);
`prefill_speed_factor` and `decode_speed_factor`, what the
conductor measured the engines to take over the profile's time by the end of the run (its
predictions are the profile's scaled by them).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np

from kvstore.bench import verdict
from kvstore.bench.options import SuiteArgs
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.bounds import StreamSettings
from kvstore.conductor import SLO, CostProfile, resolve_profile
from kvstore.conductor.front.completion import CompletionOutcome
from kvstore.conductor.front.config import ConductorConfig
from kvstore.conductor.front.live_view import LiveCluster
from kvstore.conductor.front.server import ConductorServer
from kvstore.conductor.sim.outcome import RequestOutcome, summarize
from kvstore.conductor.sim.simulator import TraceRequest

POLICIES = ("round-robin", "cache-aware", "cache-aware-reject", "cache-aware-predictive")
ROLES = ("prefill", "prefill", "decode")
TRACE_BLOCK_TOKENS = 512
OUTPUT_SCALE = 8
MAX_PROMPT_TOKENS = 2048
MAX_OUTPUT_TOKENS = 64
LIVE_SPEEDUP = 24.0
SAMPLE_S = 0.1
LIVE_DEFAULTS: Mapping[str, object] = {
    "live_model": "tiny",
    "live_requests": 200,
    "live_ttft_slo_s": 0.25,
    "live_tbt_slo_ms": 40.0,
}
QUICK_REQUESTS = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--live` and its flags (the shared `--trace`, `--speedup`, `--profile` and `--policy`
    apply too; `--policy all` means `POLICIES`)."""
    add = parser.add_argument
    add("--live", action="store_true", help="replay through real engines and the conductor")
    add("--live-model", default=LIVE_DEFAULTS["live_model"], help="engine preset (tiny, bench)")
    add("--live-requests", type=int, default=None, help="trace requests to replay")
    add("--live-ttft-slo-s", type=float, default=LIVE_DEFAULTS["live_ttft_slo_s"], help="seconds")
    add("--live-tbt-slo-ms", type=float, default=LIVE_DEFAULTS["live_tbt_slo_ms"], help="ms")


class LiveRequest(NamedTuple):
    arrival_s: float
    prompt: list[int]
    max_tokens: int


def scale_trace(
    requests: Sequence[TraceRequest], block_tokens: int, vocab: int, seed: int, speedup: float
) -> list[LiveRequest]:
    """The trace in engine tokens (see the module docstring)."""
    t0 = requests[0].timestamp_ms
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(seed * 1_000_003 + h)
            blocks[h] = [rng.randrange(vocab) for _ in range(block_tokens)]
        return blocks[h]

    scaled = []
    for r in requests:
        n = math.ceil(r.input_len * block_tokens / TRACE_BLOCK_TOKENS)
        n = max(1, min(n, MAX_PROMPT_TOKENS, len(r.hash_ids) * block_tokens))
        prompt = [t for h in r.hash_ids[: math.ceil(n / block_tokens)] for t in block(h)][:n]
        out = max(1, min(MAX_OUTPUT_TOKENS, round(r.output_len / OUTPUT_SCALE)))
        scaled.append(LiveRequest((r.timestamp_ms - t0) / 1000 / speedup, prompt, out))
    return scaled


def run(
    options: SuiteOptions, s: Mapping[str, object], requests: Sequence[TraceRequest]
) -> list[Row]:
    """One row per policy (`s`: the scheduler suite's settings, `requests`: the trace)."""
    model = str(s["live_model"])
    n = int(
        s["live_requests"] or (QUICK_REQUESTS if options.quick else LIVE_DEFAULTS["live_requests"])
    )  # type: ignore[call-overload]
    speedup = float(s["speedup"] or LIVE_SPEEDUP)  # type: ignore[arg-type]
    slo = SLO(float(s["live_ttft_slo_s"]), float(s["live_tbt_slo_ms"]) / 1000)  # type: ignore[arg-type]
    policies = POLICIES if s["policy"] == "all" else (str(s["policy"]),)
    from kvstore.bench.scheduler_live_cluster import EngineSpec, LiveProcesses  # torch: only here

    profile = _profile(str(s["profile"]), model, options.quick)
    spec = EngineSpec(model, profile.decode_kv_capacity_tokens // profile.block_tokens)
    vocab = _vocab(model)
    rows = []
    with (
        LiveProcesses(spec, ROLES) as procs,
        progress_bar("scheduler --live", n * len(policies)) as advance,
    ):
        for i, policy in enumerate(policies):
            live = scale_trace(requests[:n], profile.block_tokens, vocab, i, speedup)
            outcomes, loads, counts = asyncio.run(
                _replay(policy, procs, profile, model, slo, live, advance)
            )
            rows.append(_row(policy, speedup, slo, live, outcomes, loads, model) | counts)
    return rows


def _profile(name: str, model: str, quick: bool) -> CostProfile:
    if name != "datacenter":  # the suite's default: a live run calibrates instead
        return resolve_profile(name)
    from kvstore.bench import calibrate

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"calibration-{model}.json"
        calibrate.run(SuiteArgs(quick=quick, extra={"model": model, "out": out}))
        return CostProfile.load(out)


def _vocab(model: str) -> int:
    from gpu_engine.config import MODEL_PRESETS

    return MODEL_PRESETS[model].vocab_size


async def _replay(
    policy: str,
    procs: Any,  # kvstore.bench.scheduler_live_cluster.LiveProcesses
    profile: CostProfile,
    model: str,
    slo: SLO,
    requests: Sequence[LiveRequest],
    advance: Callable[[int], None],
) -> tuple[list[CompletionOutcome], list[float], dict[str, float]]:
    """The outcomes, the decode-load samples, and the row's counts: the hot-block copies the
    policy had the engines make (`replications` done, `replicated_blocks` they loaded) and
    the engines' measured speed factors (`kvstore.conductor.front.speed`)."""
    # The replay is one client standing in for every user of the trace: its streams are
    # bounded by the run, not by one user's share.
    streams = StreamSettings(max_streams_per_client=len(requests), max_streams=len(requests))
    config = ConductorConfig(
        engines=",".join(procs.engines), store=procs.store, policy=policy, port=0, grpc_port=-1,
        ttft_slo_s=slo.ttft_s, tbt_slo_ms=slo.tbt_s * 1000, model=model, streams=streams,
    )  # fmt: skip
    server = await ConductorServer(config, profile).start()
    outcomes: list[CompletionOutcome] = []

    def finished(outcome: CompletionOutcome) -> None:
        outcomes.append(outcome)
        advance(1)

    server.conductor.listeners.append(finished)
    copies = {"replications": 0, "replicated_blocks": 0}

    def replicated(outcome: str, num_blocks: int) -> None:
        copies["replications"] += outcome == "done"
        copies["replicated_blocks"] += num_blocks

    server.conductor.replication_listeners.append(replicated)
    loads: list[float] = []
    sampler = asyncio.create_task(_sample(server.conductor.cluster, loads))
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            t0, sent = loop.time(), []
            for r in requests:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - loop.time()))  # open-loop pacing
                sent.append(asyncio.create_task(_complete(http, url, r)))
            await asyncio.gather(*sent)
    finally:
        sampler.cancel()
        await server.stop()
    cluster = server.conductor.cluster
    speeds = {  # what the predictions were scaled by at the end of the run
        "prefill_speed_factor": cluster.prefill_speed.factor(cluster.now_s),
        "decode_speed_factor": cluster.decode_speed.factor(cluster.now_s),
    }
    return sorted(outcomes, key=lambda o: o.request_id), loads, copies | speeds


async def _complete(http: aiohttp.ClientSession, url: str, r: LiveRequest) -> None:
    body = {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "stream": True}
    async with http.post(url, json=body) as response:
        await response.read()  # the whole stream (or the 429); the conductor records it


async def _sample(cluster: LiveCluster, loads: list[float]) -> None:
    while True:
        decodes = cluster.decodes
        loads.append(sum(d.context_tokens() / d.kv_capacity_tokens for d in decodes) / len(decodes))
        await asyncio.sleep(SAMPLE_S)  # the sampling period


def _row(
    policy: str,
    speedup: float,
    slo: SLO,
    requests: Sequence[LiveRequest],
    outcomes: Sequence[CompletionOutcome],
    loads: Sequence[float],
    model: str,
) -> Row:
    sim = [
        RequestOutcome(
            o.request_id,
            o.rejected.reason if o.rejected else None,
            o.ttft_s,
            o.tbt_s,
            o.prefilled_tokens,
        )
        for o in outcomes
    ]
    m = summarize(sim, slo, requests[-1].arrival_s, loads)
    return {
        "policy": policy,
        "speedup": speedup,
        **m._asdict(),  # the simulator's columns, the same in every row
        **_prediction_error(outcomes),
        "failed": sum(
            o.rejected is None and not o.finish_reason.startswith(("length", "stop"))
            for o in outcomes
        ),
        "unrecorded": len(requests) - len(outcomes),  # sent, but no outcome: turned away early
        "live_model": model,
        "ttft_slo_s": slo.ttft_s,
        "tbt_slo_ms": slo.tbt_s * 1000,
    }


def _prediction_error(outcomes: Sequence[CompletionOutcome]) -> dict[str, float]:
    pairs = [
        (o.predicted_ttft_s, o.ttft_s)
        for o in outcomes
        if o.rejected is None and o.predicted_ttft_s is not None and o.ttft_s == o.ttft_s
    ]
    if not pairs:
        nan = float("nan")
        return {
            "ttft_pred_err_p50_s": nan,
            "ttft_pred_err_p90_s": nan,
            "ttft_pred_rel_err_p50": nan,
            "ttft_pred_bias_s": nan,
        }
    predicted, measured = np.array(pairs).T
    err = np.abs(predicted - measured)
    return {
        "ttft_pred_err_p50_s": float(np.percentile(err, 50)),
        "ttft_pred_err_p90_s": float(np.percentile(err, 90)),
        "ttft_pred_rel_err_p50": float(np.percentile(err / measured, 50)),
        "ttft_pred_bias_s": float(np.mean(predicted - measured)),
    }


COMPARED = ("round-robin", "cache-aware-reject", "cache-aware-predictive")
OURS = "cache-aware-predictive"
MIN_ACCEPTED_ATTAINMENT = 0.95  # of the requests it admits, over the whole run
MAX_PREDICTION_ERROR = 0.2  # median |predicted - measured| TTFT over the measured


def is_live(rows: Sequence[Row]) -> bool:
    """Whether `rows` are a `--live` run's."""
    return bool(rows) and all("live_model" in r for r in rows)


def failures(rows: Sequence[Row]) -> list[str]:
    """The live targets missed or unmeasured: a policy of `COMPARED` that did not run;
    cache-aware-predictive meeting both objectives on fewer than 95% of the requests it
    admitted, or predicting TTFT off by 20% of the measured or more at the median."""
    by = {str(r["policy"]): r for r in rows}
    out = [f"unmeasured: no row of {p}" for p in COMPARED if p not in by]
    out += [
        f"unmeasured: {p} left {r['unrecorded']} requests without an outcome"
        for p, r in by.items()
        if r.get("unrecorded")
    ]
    if OURS not in by:
        return out
    ours = by[OURS]
    attainment = float(ours["accepted_slo_attainment"])  # type: ignore[arg-type]
    error = float(ours["ttft_pred_rel_err_p50"])  # type: ignore[arg-type]
    if not attainment >= MIN_ACCEPTED_ATTAINMENT:
        out.append(f"{OURS}: accepted attainment {attainment:.3f} < {MIN_ACCEPTED_ATTAINMENT}")
    if math.isnan(error):
        out.append(f"unmeasured: {OURS} served nothing whose TTFT it predicted")
    elif error >= MAX_PREDICTION_ERROR:
        out.append(f"{OURS}: TTFT prediction error {error:.3f} of the measured >= 0.2")
    return out


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a live target is missed or unmeasured (listed on stderr), else 0."""
    return verdict.exit_status(failures(rows))
