"""Engine and model configs: frozen dataclasses, validated on construction.

`EngineConfig` fields are declared with `kvstore.config.option`, so CLI flags, environment
variables and config-file keys come from this one table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kvstore.config import option
from kvstore.errors import InvalidArgumentError
from kvstore.keys import KVLayout, Namespace

_TORCH_DTYPES = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-architecture decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            _check_positive(name, getattr(self, name))
        _check_positive("num_heads", self.num_heads)
        _check_positive("num_kv_heads", self.num_kv_heads)
        _check_positive("max_position", self.max_position)
        if self.hidden_size % self.num_heads:
            raise InvalidArgumentError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise InvalidArgumentError("head_dim must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Random weights from a fixed seed. `tiny` is for tests. `bench` is sized for CPU benchmarks:
# a one-shot 8192-token fp32 prefill measured 7.5-8.1 s of CPU time, 4.6-6.7 s wall on 2 busy
# cores (2.5 s wall with 4 layers); attention is about half of it.
MODEL_PRESETS: MappingProxyType[str, ModelConfig] = MappingProxyType(
    {
        "tiny": ModelConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position=4096,
        ),
        "bench": ModelConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1408,
            num_layers=6,
            num_heads=8,
            num_kv_heads=2,
        ),
    }
)


class EngineRole(enum.Enum):
    """What an engine does with the requests it is given (`gpu_engine.role` says how).

    BOTH computes the prompt and decodes. PREFILL computes the prompt, samples the first
    token and finishes the request once the prompt's full blocks are committed in the store.
    DECODE loads the prompt's full blocks from the store, computes the rest and decodes; a
    conductor hands each request from a PREFILL engine to a DECODE one.
    """

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


ROLE_NAMES = tuple(r.value for r in EngineRole)


@dataclass(frozen=True)
class EngineConfig:
    """One engine: model, KV pages, batching limits and its role."""

    model: str = option("tiny", f"model size preset, one of {sorted(MODEL_PRESETS)}")
    model_id: str = option("", "model id in the KV namespace (default: gpu_engine/<model>)")
    weights_path: str = option("", "safetensors file of weights (default: random from seed)")
    device: str = option("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = option("float32", f"weights and KV dtype, one of {sorted(_TORCH_DTYPES)}")
    block_tokens: int = option(16, "tokens per store block and per prefix-cache entry")
    page_tokens: int = option(16, "tokens per KV page; must divide block_tokens")
    num_pages: int = option(1024, "KV pages in the pool")
    max_num_seqs: int = option(32, "most sequences running at once")
    max_prefill_tokens: int = option(2048, "most prompt tokens computed per step (chunking)")
    enable_prefix_cache: bool = option(True, "reuse full blocks across requests")
    async_load: bool = option(
        True, "load (and, as prefill, publish) store blocks off the step loop (False: inline)"
    )
    seed: int = option(0, "seed of the random weights and of unseeded sampling")
    tenant_salt: str = option("", "tenant salt of the KV namespace, hex")
    role: str = option(
        "both",
        f"what this engine runs, one of {list(ROLE_NAMES)}: both, prefill (compute "
        "and publish the prompt, then finish) or decode (load the prompt, then decode)",
    )

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise InvalidArgumentError(
                f"unknown model {self.model!r}; known: {sorted(MODEL_PRESETS)}"
            )
        if self.role not in ROLE_NAMES:
            raise InvalidArgumentError(f"role must be one of {list(ROLE_NAMES)}, got {self.role!r}")
        if self.dtype not in _TORCH_DTYPES:
            raise InvalidArgumentError(f"unknown dtype {self.dtype!r}; known: {_TORCH_DTYPES}")
        for name in ("block_tokens", "page_tokens", "num_pages", "max_num_seqs"):
            _check_positive(name, getattr(self, name))
        _check_positive("max_prefill_tokens", self.max_prefill_tokens)
        if self.block_tokens % self.page_tokens:
            raise InvalidArgumentError("page_tokens must divide block_tokens")
        try:
            bytes.fromhex(self.tenant_salt)
        except ValueError as exc:
            raise InvalidArgumentError(f"tenant_salt must be hex: {exc}") from exc

    @property
    def model_config(self) -> ModelConfig:
        return MODEL_PRESETS[self.model]

    @property
    def engine_role(self) -> EngineRole:
        return EngineRole(self.role)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    @property
    def kv_layout(self) -> KVLayout:
        m = self.model_config
        return KVLayout(self.dtype, m.num_layers, m.num_kv_heads, m.head_dim, self.block_tokens)

    @property
    def namespace(self) -> Namespace:
        model_id = self.model_id or f"gpu_engine/{self.model}"
        return Namespace(model_id, self.kv_layout, bytes.fromhex(self.tenant_salt))
