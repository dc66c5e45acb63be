"""Suite `calibrate`: fits the conductor's cost model (`kvstore.conductor.CostProfile`) to
the real engine and store on this machine, and saves it as a profile.

Three measurements, each fitted by nonnegative least squares to the form the cost model
predicts with (see `CostProfile`):

- prefill: in-process engines time prompts of `n` tokens whose first `p` are in the
  engine's prefix cache; time ~ overhead + per_token * (n - p) + per_pair * (n^2 - p^2).
- decode: `B` sequences of `c` context tokens decode together; the step time (the mean
  time per output token) ~ overhead + per_seq * B + per_context_token * (B * c).
- transfer: a store node (UCX when installed, else gRPC) serves `k` blocks of the engine's
  block size; time ~ latency + k * block_bytes / bandwidth.

One row per measurement, with the fitted prediction and its error; the profile goes to
`--out` (JSON), for `kvstore-bench scheduler --profile PATH`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvstore.bench.calibrate_fit import Fit, fit_nonnegative
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions

DEFAULT_OUT = Path("calibration.json")
REPEATS = 3
# (n, p) prompt and cached tokens; B sequences x c context tokens; k blocks.
PREFILL = {
    False: [(n, p) for n in (256, 512, 1024, 2048) for p in (0, n // 4, n // 2, 3 * n // 4)],
    True: [(n, p) for n in (128, 256, 512) for p in (0, n // 2)],
}
DECODE = {
    False: [(b, c) for b in (1, 4, 8, 16) for c in (64, 256, 1024)],
    True: [(b, c) for b in (1, 4, 8) for c in (64, 256)],
}
TRANSFER = {False: (1, 4, 16, 64, 128), True: (1, 8, 32)}
DECODE_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    add = parser.add_argument
    add("--model", default="bench", help="engine model preset to calibrate (tiny, bench)")
    add("--out", type=Path, default=DEFAULT_OUT, help="where the fitted profile is written")


def run(options: SuiteOptions) -> list[Row]:
    extra = extra_of(options)
    model, out = str(extra.get("model", "bench")), Path(str(extra.get("out", DEFAULT_OUT)))
    config = _engine_config(model)
    quick = options.quick
    total = len(PREFILL[quick]) + len(DECODE[quick]) + len(TRANSFER[quick])
    with progress_bar("calibrate", total) as advance:
        prefill = _measure_prefill(config, PREFILL[quick], advance)
        decode = _measure_decode(config, DECODE[quick], advance)
        transfer = _measure_transfer(config, TRANSFER[quick], advance)
    rows, fits = [], {}
    for name, points in (("prefill", prefill), ("decode", decode), ("transfer", transfer)):
        fits[name] = fit_nonnegative([f for f, _, _ in points], [t for _, t, _ in points])
        rows += _rows(name, points, fits[name])
    profile = _profile(config, model, fits)
    profile.save(out)
    print(f"profile {profile.name!r} written to {out}")
    return rows


def _engine_config(model: str):
    from gpu_engine.config import EngineConfig

    # Prompts up to 2048 tokens in one step; pages for 16 x (1024 + 8) decoding tokens.
    return EngineConfig(model=model, max_prefill_tokens=4096, num_pages=2048, max_num_seqs=32)


def _tokens(rng: np.random.Generator, config, n: int) -> list[int]:
    return rng.integers(0, config.model_config.vocab_size, n).tolist()


Point = tuple[list[float], float, dict[str, int]]  # features, seconds, what was measured


def _seconds(measured: float | None) -> float:
    """An output's TTFT or TPOT: None only for a prefetch (no token) or, a TPOT, one token,
    neither of which a measurement here makes (prefill: 1 token; decode: DECODE_TOKENS)."""
    assert measured is not None, "a measured request without its time"
    return measured


def _measure_prefill(config, cases: Sequence[tuple[int, int]], advance: Callable) -> list[Point]:
    from gpu_engine.engine import Engine
    from gpu_engine.sampling import SamplingParams

    engine, rng, first = Engine(config), np.random.default_rng(0), SamplingParams(max_tokens=1)
    engine.generate([_tokens(rng, config, 64)], first)  # warm-up: allocator, kernels
    points = []
    for n, p in cases:
        p -= p % config.block_tokens  # only whole blocks are cached
        times = []
        for _ in range(REPEATS):
            prompt = _tokens(rng, config, n)
            if p:
                engine.generate([prompt[:p]], first)  # its blocks now in the prefix cache
            out = engine.generate([prompt], first)[0]
            assert out.usage.local_cached_tokens == p, (out.usage, p)
            times.append(_seconds(out.metrics.ttft_s))
        points.append(([1.0, n - p, n * n - p * p], statistics.median(times), {"n": n, "p": p}))
        advance(1)
    engine.close()
    return points


def _measure_decode(config, cases: Sequence[tuple[int, int]], advance: Callable) -> list[Point]:
    from gpu_engine.engine import Engine
    from gpu_engine.sampling import SamplingParams

    engine, rng = Engine(config), np.random.default_rng(1)
    params = SamplingParams(max_tokens=DECODE_TOKENS)
    points = []
    for b, c in cases:
        times = []
        for _ in range(REPEATS):
            outs = engine.generate([_tokens(rng, config, c) for _ in range(b)], params)
            times.append(statistics.median(_seconds(o.metrics.tpot_s) for o in outs))
        context = b * (c + DECODE_TOKENS / 2)  # mean context over the decode steps
        points.append(([1.0, b, context], statistics.median(times), {"B": b, "c": c}))
        advance(1)
    engine.close()
    return points


def _measure_transfer(config, cases: Sequence[int], advance: Callable) -> list[Point]:
    from kvstore.client import Client
    from kvstore.node.server import EmbeddedServer
    from kvstore.store.config import StoreConfig

    ns = config.namespace
    num_blocks = max(cases)
    blocks = [np.full(ns.block_bytes, i % 251, np.uint8) for i in range(num_blocks)]
    keys = [i.to_bytes(8, "little") * 4 for i in range(num_blocks)]
    dram = 2 * num_blocks * ns.block_bytes + (64 << 20)
    points = []
    with EmbeddedServer(StoreConfig(dram_bytes=dram)) as server, Client(server.address) as c:
        c.register_namespace(ns)
        c.put_chain(ns.id, keys, blocks)
        into = [np.empty(ns.block_bytes, np.uint8) for _ in range(num_blocks)]
        c.get_into(ns.id, keys[:1], into[:1])  # connects the data plane
        for k in cases:
            times = []
            for _ in range(REPEATS * 2):
                start = time.perf_counter()
                assert all(c.get_into(ns.id, keys[:k], into[:k]))
                times.append(time.perf_counter() - start)
            points.append(([1.0, k * ns.block_bytes], statistics.median(times), {"k": k}))
            advance(1)
    return points


def _rows(name: str, points: list[Point], fit: Fit) -> list[Row]:
    rows: list[Row] = []
    for features, seconds, case in points:
        predicted = fit.predict(features)
        rows.append(
            {
                "fit": name,
                "case": " ".join(f"{k}={v}" for k, v in case.items()),
                "measured_ms": seconds * 1e3,
                "predicted_ms": predicted * 1e3,
                "error": (predicted - seconds) / seconds,
                "fit_r2": fit.r2,
            }
        )
    return rows


def _profile(config, model: str, fits: dict[str, Fit]):
    import socket

    from kvstore.conductor.profile import CostProfile
    from kvstore.store.config import StoreConfig

    m = config.model_config
    kv_bytes_per_token = config.namespace.block_bytes // config.block_tokens
    prefill, decode, transfer = fits["prefill"].coefs, fits["decode"].coefs, fits["transfer"].coefs
    bandwidth = 1.0 / transfer[1] if transfer[1] > 0 else 1e12  # bytes/s; 0 s/byte: unmeasurable
    blocks_of_pages = config.num_pages // config.pages_per_block
    return CostProfile(
        name=f"calibrated: {model} ({m.num_layers} layers) on {socket.gethostname()}",
        block_tokens=config.block_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_overhead_s=prefill[0],
        prefill_s_per_token=max(prefill[1], 1e-9),  # the profile needs a positive rate
        prefill_s_per_token_pair=prefill[2],
        decode_step_overhead_s=decode[0],
        decode_s_per_seq=decode[1],
        decode_s_per_context_token=decode[2],
        pool_bandwidth_bytes_per_s=bandwidth,
        transfer_latency_s=transfer[0],
        decode_kv_capacity_tokens=config.num_pages * config.page_tokens,
        prefill_cache_blocks=blocks_of_pages,
        pool_capacity_blocks=StoreConfig().dram_bytes // config.namespace.block_bytes,  # a node
    )
