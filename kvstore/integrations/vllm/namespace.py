"""The namespace of a vLLM engine's blocks: its model, KV layout and paged layout's device.

Engines share blocks only where all of them agree: the model id (vLLM's model name unless
the connector names one), the cache's dtype, layers, KV heads, head size and block size,
and the device kind (a CPU and a GPU engine lay pages out differently); a request's
`cache_salt` is the tenant salt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.keys import KVLayout, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _cache_dtype(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype in (None, "auto"):
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(
        cache_dtype, cache_dtype
    )


def namespace_for(vllm_config: VllmConfig, model_id: str, salt: str | None) -> Namespace:
    """The namespace of one engine's blocks; the device kind names the paged layout."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    layout = KVLayout(
        _cache_dtype(vllm_config),
        model.get_num_layers(parallel),
        model.get_num_kv_heads(parallel),
        model.get_head_size(),
        vllm_config.cache_config.block_size,
    )
    device = vllm_config.device_config.device_type
    name = f"vllm/{device}/{model_id or model.model}"
    return Namespace(name, layout, (salt or "").encode())
