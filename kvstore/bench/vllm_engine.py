"""One vLLM process: serve sessions of token prompts one request at a time, time them.

Run as ``python -m kvstore.bench.vllm_engine SPEC.json OUT.json`` in a venv with vLLM. The spec
names the model, the connector and the sessions; each session is a list of turns, and turn
``i``'s prompt is every earlier turn and answer followed by turn ``i`` (multi-round QA).
The output lists, per request, TTFT, TPOT, the output token ids, vLLM's cached-token
count and the minor page faults its processes took meanwhile (first touches of memory).
Tests and `kvstore-bench vllm` both drive vLLM through this file. With ``"in_process":
true`` the engine core and its worker run in this process (the connector's scheduler and
worker sides still run apart, as in a deployment); tests use it, since each extra vLLM
process costs seconds of imports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 32  # vLLM's block size here, unless a spec says otherwise

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
SHUTDOWN_S = 60.0


def kv_transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `kv_transfer_config` for the spec's connector; None for plain recompute."""
    kind = spec["connector"]
    if kind == "kvstore":
        extra = {"kvstore.address": spec["store"], **spec.get("connector_extra", {})}
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if kind == "lmcache":
        extra = {
            "lmcache.mp.host": f"tcp://{spec.get('lmcache_host', '127.0.0.1')}",
            "lmcache.mp.port": spec["lmcache_port"],
            **spec.get("connector_extra", {}),
        }
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if kind == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
        }
    if kind == "null":
        return {
            "kv_connector": "NullConnector",
            "kv_connector_module_path": "kvstore.bench.null_connector",
            "kv_role": "kv_both",
        }
    assert kind == "recompute", f"unknown connector {kind!r}"
    return None


def make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kv = kv_transfer_config(spec)
    in_process = spec.get("in_process", False)
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return LLM(
        distributed_executor_backend="uni" if in_process else None,
        model=spec["model"],
        dtype="float32",
        block_size=spec.get("block_size", BLOCK_TOKENS),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        enforce_eager=True,
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_transfer_config=kv,
        seed=0,
    )


def minor_faults() -> int:
    """Minor page faults so far of this process and every process under it (vLLM's engine
    core runs in a child): a first touch of fresh memory is one; a reused page is none."""
    total, pids = 0, [os.getpid()]
    while pids:
        pid = pids.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            total += int(stat.rsplit(")", 1)[1].split()[7])  # field 10, minflt
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # gone, or a kernel without the children file
            continue
    return total


def run_request(engine: Any, req_id: str, tokens: list[int], max_tokens: int, salt: str | None):
    """Serves one request alone; returns its record and output token ids."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt:
        prompt["cache_salt"] = salt
    faults = minor_faults()
    start = time.perf_counter()
    engine.add_request(req_id, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    end = time.perf_counter()
    ids = list(final.outputs[0].token_ids)
    tpot = (end - first) / max(len(ids) - 1, 1) if first else 0.0
    record = {
        "ttft_s": (first or end) - start,
        "tpot_s": tpot,
        "cached_tokens": final.num_cached_tokens or 0,
        "prompt_len": len(tokens),
        "output": ids,
        "minor_faults": minor_faults() - faults,
    }
    return record, ids


def run_sessions(engine: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    records = []
    for s, session in enumerate(spec["sessions"]):
        history: list[int] = []
        for t, turn in enumerate(session["turns"]):
            tokens = history + turn
            rec, out = run_request(
                engine, f"s{s}t{t}", tokens, spec["max_tokens"], session.get("salt")
            )
            records.append({"session": s, "turn": t, **rec})
            history = tokens + out
    return records


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    llm = make_llm(spec)
    records = run_sessions(llm.llm_engine, spec)
    Path(sys.argv[2]).write_text(json.dumps(records))
    # Shutting the engine down flushes the connector's background saves; vLLM's default
    # gives the engine process 5 s before killing it, too short on a busy host.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)


if __name__ == "__main__":
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    main()
