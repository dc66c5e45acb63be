"""Cost-model profiles: the coefficients the conductor predicts with, saved as JSON.

A profile is what `kvstore-bench calibrate` fits on a real deployment; until then the
built-in `DATACENTER` profile lets simulations speak of realistic scale. It is derived, not
measured, from published figures:

- Model and hardware: the Mooncake paper (Qin et al., "Mooncake: A KVCache-centric
  Disaggregated Architecture for LLM Serving", FAST'25 / arXiv 2407.00079) serves a dummy
  LLaMA2-70B (l = 80 layers, d = 8192, GQA with 8 KV heads of 128) on nodes of 8 NVIDIA
  A800 80GB, and models prefill as flops(n) = l (a n^2 d + b n d^2) with a = 4, b = 22.
  One instance here is one such node, tensor-parallel over its 8 GPUs.
- GPU datasheet (NVIDIA A100/A800 80GB SXM): 312 TFLOPS dense BF16, 2.039 TB/s HBM2e.
- Model FLOPs utilisation: 46.2%, the figure PaLM (Chowdhery et al., 2022, Table 3)
  reports for a large dense transformer; prefill is compute-bound like training.
- Memory-bandwidth utilisation of decode: 60%, about what Databricks' "LLM Inference
  Performance Engineering: Best Practices" (2023) measured for 70B-class models on A100s.
- Pool bandwidth: Mooncake's Transfer Engine reaches about 190 GB/s on 8x400 Gbps RoCE
  (FAST'25 paper, Transfer Engine section); a block moves at that rate plus a fixed latency.
- KV bytes: 2 (K, V) x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680 bytes a token.
- Decode KV capacity: what vLLM leaves for KV at its default `gpu_memory_utilization` of
  0.9 (the default when the paper was written): 0.9 x 640 GB of HBM less the 140 GB of
  BF16 weights, 436 GB or 1.33M tokens. The local prefix cache of a prefill node is its
  spare HBM, 300 GB; the global pool is 1 TB of DRAM per prefill node.
- Decode step, calibrated: the terms above (weights and KV read at the measured bandwidth
  use, one token's matmuls per sequence at the MFU) give 24 ms for a step of 32 sequences
  of about 1,024 tokens of LLaMA2-70B on 8 A100 40GB (1.555 TB/s), where the published
  `llm_benchmark` runs (github.com/rkooo567/llm_benchmark: batch 32, 2,048 output
  tokens, tensor parallel 8) took 70.19 s with TensorRT-LLM (34 ms a step) and 133.70 s
  with vLLM (65 ms): the bandwidth arithmetic misses what tensor parallelism costs a
  small step (an all-reduce per layer, kernel launches). Every decode term is scaled by
  the measured / derived ratio of the faster engine, 1.43. An engine's cap on sequences
  per batch (vLLM's `max_num_seqs`, 256 on A100-class GPUs) is not modelled: where decode
  binds on the bundled traces, the TBT objective or the KV capacity holds a batch to about
  100-170 sequences on average, so the cap can bind only at peaks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class CostProfile:
    """The coefficients of `CostModel`; every time in seconds.

    Prefill of `n` prompt tokens of which the first `p` are cached takes
    ``prefill_overhead_s + prefill_s_per_token * (n - p) + prefill_s_per_token_pair * (n^2 - p^2)``
    (flops(n) - flops(p) over the instance's sustained FLOP rate). A decode step over a batch
    of `B` sequences holding `T` context tokens takes
    ``decode_step_overhead_s + decode_s_per_seq * B + decode_s_per_context_token * T``
    (weights read once, per-sequence compute, the KV read). Moving `k` blocks from the pool
    takes ``transfer_latency_s + k * block_tokens * kv_bytes_per_token / pool_bandwidth``.

    Attributes:
        name: what the profile describes.
        block_tokens: tokens per KV block (the trace's hash ids are one per block).
        kv_bytes_per_token: KV bytes of one token over all layers.
        prefill_overhead_s, prefill_s_per_token, prefill_s_per_token_pair: prefill time.
        decode_step_overhead_s, decode_s_per_seq, decode_s_per_context_token: decode step.
        pool_bandwidth_bytes_per_s, transfer_latency_s: pool -> instance transfer.
        decode_kv_capacity_tokens: KV tokens one decode instance holds.
        prefill_cache_blocks: blocks one prefill instance's local prefix cache holds.
        pool_capacity_blocks: blocks the global pool holds, per prefill instance.
        gpus_per_instance: GPUs one instance runs on (wasted work is counted in GPU-seconds).
    """

    name: str
    block_tokens: int
    kv_bytes_per_token: int
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_pair: float
    decode_step_overhead_s: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    pool_bandwidth_bytes_per_s: float
    transfer_latency_s: float
    decode_kv_capacity_tokens: int
    prefill_cache_blocks: int
    pool_capacity_blocks: int
    gpus_per_instance: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not value >= 0:
                raise ValueError(f"CostProfile.{f.name} must be >= 0: {value!r}")
        positive = ("block_tokens", "kv_bytes_per_token", "pool_bandwidth_bytes_per_s")
        for name in (*positive, "decode_kv_capacity_tokens", "prefill_s_per_token"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostProfile.{name} must be > 0")

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block."""
        return self.block_tokens * self.kv_bytes_per_token

    def scaled(self, prefill: float, decode: float) -> CostProfile:
        """This profile on instances whose prefill work (compute and loads from the pool)
        takes `prefill` times as long, and whose decode steps `decode` times as long;
        sizes and capacities unchanged."""
        if not (prefill > 0 and decode > 0):
            raise ValueError(f"speed factors must be > 0: prefill {prefill}, decode {decode}")
        return dataclasses.replace(
            self,
            prefill_overhead_s=self.prefill_overhead_s * prefill,
            prefill_s_per_token=self.prefill_s_per_token * prefill,
            prefill_s_per_token_pair=self.prefill_s_per_token_pair * prefill,
            transfer_latency_s=self.transfer_latency_s * prefill,
            pool_bandwidth_bytes_per_s=self.pool_bandwidth_bytes_per_s / prefill,
            decode_step_overhead_s=self.decode_step_overhead_s * decode,
            decode_s_per_seq=self.decode_s_per_seq * decode,
            decode_s_per_context_token=self.decode_s_per_context_token * decode,
        )

    def to_json(self) -> str:
        """The profile as a JSON object (`from_json` reads it back equal)."""
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        """A profile from `to_json` text; ValueError on unknown, missing or bad fields."""
        try:
            return cls(**json.loads(text))
        except TypeError as exc:
            raise ValueError(f"not a CostProfile: {exc}") from None

    def save(self, path: Path) -> None:
        """Writes the profile to `path` as JSON."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        """Reads a profile saved by `save`."""
        return cls.from_json(path.read_text())


_FLOPS_PER_S = 8 * 312e12 * 0.462  # 8 A100/A800s at PaLM's MFU
_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2  # LLaMA2-70B: K and V, 80 layers, 8 KV heads
_WEIGHTS_BYTES = 70e9 * 2  # BF16


def _derived_step_s(hbm_bytes_per_s: float, num_seqs: int, context_tokens: float) -> float:
    """A LLaMA2-70B decode step on 8 GPUs of `hbm_bytes_per_s` each, by the bandwidth
    arithmetic: the weights and the KV read at 60% of the bandwidth, and each sequence's
    matmuls at the MFU."""
    read_per_s = 8 * hbm_bytes_per_s * 0.60
    return (
        _WEIGHTS_BYTES / read_per_s
        + num_seqs * 2 * 70e9 / _FLOPS_PER_S
        + context_tokens * _KV_BYTES_PER_TOKEN / read_per_s
    )


# TensorRT-LLM's measured step over the derived one, at the published point (see above).
DECODE_CALIBRATION = (70.19 / 2048) / _derived_step_s(1.555e12, 32, 32 * 1024)


def _datacenter() -> CostProfile:
    layers, hidden, a, b = 80, 8192, 4, 22  # Mooncake's flops model of LLaMA2-70B
    hbm = 2.039e12  # one A800 80GB
    block_bytes = 512 * _KV_BYTES_PER_TOKEN
    step_overhead = _derived_step_s(hbm, 0, 0)
    return CostProfile(
        name="datacenter: LLaMA2-70B on 8x A800 per instance (derived from published figures)",
        block_tokens=512,
        kv_bytes_per_token=_KV_BYTES_PER_TOKEN,
        prefill_overhead_s=0.0,
        prefill_s_per_token=layers * b * hidden**2 / _FLOPS_PER_S,
        prefill_s_per_token_pair=layers * a * hidden / _FLOPS_PER_S,
        decode_step_overhead_s=DECODE_CALIBRATION * step_overhead,
        decode_s_per_seq=DECODE_CALIBRATION * (_derived_step_s(hbm, 1, 0) - step_overhead),
        decode_s_per_context_token=DECODE_CALIBRATION
        * (_derived_step_s(hbm, 0, 1) - step_overhead),
        pool_bandwidth_bytes_per_s=190e9,
        transfer_latency_s=0.001,
        decode_kv_capacity_tokens=int((0.9 * 8 * 80e9 - _WEIGHTS_BYTES) / _KV_BYTES_PER_TOKEN),
        prefill_cache_blocks=int(300e9 // block_bytes),
        pool_capacity_blocks=int(1e12 // block_bytes),
        gpus_per_instance=8,
    )


DATACENTER = _datacenter()
PROFILES: MappingProxyType[str, CostProfile] = MappingProxyType({"datacenter": DATACENTER})


def resolve_profile(name_or_path: str) -> CostProfile:
    """A built-in profile by name, else a JSON profile file at that path.

    Raises:
        ValueError: neither a known name nor a readable profile file.
    """
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown profile {name_or_path!r}: not one of {sorted(PROFILES)}, no file"
        )
    return CostProfile.load(path)
