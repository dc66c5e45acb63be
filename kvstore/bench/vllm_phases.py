"""`kvstore-bench vllm --phases`: where the time of the kvstore connector's loads goes.

A writer process serves documents A and B (publishing their blocks); then, for each load
mode (`MODES`), a fresh reader process, its connector logging at debug level and publishing
nothing, asks A (its first load: every fixed cost of a fresh process), B (a later load)
and A again (served from vLLM's own prefix cache: the baseline of the effective load
bandwidth). One row per reader request: TTFT, the connector's phases (`event=match_phases`
on the scheduler side, `event=load_phases` on the worker side), the rest of the TTFT
(vLLM's scheduling and the forward pass), the minor page faults of vLLM's processes
meanwhile (first touches of memory) and the bandwidth of the load alone and of the TTFT
over the baseline. A load by layer runs beside the forward pass: its phases are its
critical path only (`wait` for a layer, `transfer` after the forward).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from kvstore.bench.report import Row

PHASE_FIELD = re.compile(r"(\w+)_ms=([\d.]+)")
ORDER = ("A (first load)", "B (later load)", "A (vLLM's own cache)")
MODES = ("staged", "by_layer")  # the connector's `load_by_layer` off and on


def sessions(doc_tokens: int, question_len: int, seed: int = 1) -> dict[str, list[dict]]:
    """The writer's and the reader's sessions over two documents."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 2000) for _ in range(doc_tokens)] for _ in range(2)]
    asks = [d + [rng.randrange(3, 2000) for _ in range(question_len)] for d in docs]
    writer = [{"turns": [d + [rng.randrange(3, 2000) for _ in range(question_len)]]} for d in docs]
    return {
        "writer": writer,
        "reader": [{"turns": [asks[0]]}, {"turns": [asks[1]]}, {"turns": [asks[0]]}],
    }


def parse_phases(log_text: str, event: str) -> dict[str, dict[str, float]]:
    """Each `event=<event>` line's `*_ms` fields and `bytes`, by request (`s<i>t<j>`, the
    engine driver's id without vLLM's suffix); a request's first line wins."""
    phases: dict[str, dict[str, float]] = {}
    for line in log_text.splitlines():
        found = re.search(rf"event={event} req=(s\d+t\d+)\S*", line)
        if found is None:
            continue
        fields = {k: float(v) for k, v in PHASE_FIELD.findall(line)}
        size = re.search(r"\bbytes=(\d+)", line)
        fields["bytes"] = float(size.group(1)) if size else 0.0
        phases.setdefault(found.group(1), fields)
    return phases


def phase_rows(
    records: list[dict[str, Any]], log_text: str, doc_tokens: int, mode: str = "staged"
) -> list[Row]:
    """One row per reader request: TTFT and the phases that account for it."""
    matches = parse_phases(log_text, "match_phases")
    loads = parse_phases(log_text, "load_phases")
    base_ms = records[2]["ttft_s"] * 1e3
    rows: list[Row] = []
    for i, (name, rec) in enumerate(zip(ORDER, records, strict=True)):
        req = f"s{rec['session']}t{rec['turn']}"
        ttft_ms = rec["ttft_s"] * 1e3
        load, match = loads.get(req, {}), matches.get(req, {})
        accounted = load.get("total", 0.0) + match.get("total", 0.0)
        row: Row = {"doc_tokens": doc_tokens, "mode": mode, "request": name}
        row["ttft_ms"] = round(ttft_ms, 1)
        row |= {f"sched_{k}_ms": round(match.get(k, 0.0), 2) for k in ("keys", "match")}
        for phase in ("connect", "submit", "wait", "transfer", "scatter"):
            row[f"{phase}_ms"] = round(load.get(phase, 0.0), 2)
        row["rest_ms"] = round(ttft_ms - accounted, 1)
        row["minor_faults"] = rec.get("minor_faults")
        row["load_mib"] = round(load.get("bytes", 0.0) / 2**20, 1)
        row["load_gbps"] = _gbps(load.get("bytes", 0.0), load.get("total", 0.0))
        over_base = ttft_ms - base_ms if i < 2 else 0.0
        row["effective_gbps"] = _gbps(load.get("bytes", 0.0), over_base)
        rows.append(row)
    return rows


def _gbps(num_bytes: float, ms: float) -> float | None:
    return round(num_bytes / (ms / 1e3) / 1e9, 3) if num_bytes and ms > 0 else None


def reader_spec(mode: str) -> dict[str, Any]:
    """Spec keys of a reader: its connector loads in `mode`, logs its phases and publishes
    nothing (so each reader finds what the writer left, no more)."""
    extra = {"kvstore.log_level": "DEBUG", "kvstore.save": False}
    return {"connector_extra": extra | {"kvstore.load_by_layer": mode == "by_layer"}}


def read_log(path: Path) -> str:
    return path.read_text(errors="replace")
