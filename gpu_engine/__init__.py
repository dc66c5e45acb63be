"""Co-located decode engine: a Llama-architecture model over a paged KV cache.

`Engine` runs requests with continuous batching and chunked prefill, reuses full blocks from
its local prefix cache and, through a `KVConnector`, from the store.
"""

from gpu_engine.config import MODEL_PRESETS, EngineConfig, EngineRole, ModelConfig
from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector, NoopConnector
from gpu_engine.engine import Engine
from gpu_engine.errors import (
    BlockSizeError,
    EngineError,
    InvalidRequestError,
    OutOfPagesError,
    PublishError,
)
from gpu_engine.kv_cache import KVCache
from gpu_engine.outputs import RequestMetrics, RequestOutput, Usage
from gpu_engine.page_pool import PagePool
from gpu_engine.request import RequestStatus
from gpu_engine.sampling import SamplingParams

__all__ = [
    "MODEL_PRESETS",
    "BlockPages",
    "BlockSizeError",
    "ConnectorRequest",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineRole",
    "InvalidRequestError",
    "KVCache",
    "KVConnector",
    "ModelConfig",
    "NoopConnector",
    "OutOfPagesError",
    "PagePool",
    "PublishError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Usage",
]
