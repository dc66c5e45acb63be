"""A vLLM KV connector that does nothing: what vLLM's connector machinery costs by itself.

`kvstore-bench vllm --tpot` runs it beside no connector and kvstore's, so a TPOT gap can
be split into vLLM's share (this connector vs none) and the connector's own (kvstore's vs
this). Loaded by vLLM from `kv_connector_module_path` ("kvstore.bench.null_connector").
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    """Never has a prefix, never loads, never saves."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None
