"""Publishing an engine's computed KV blocks to the store off its step loop, with bounded
staging: shared by every engine connector (gpu_engine's and vLLM's). Needs torch."""

from kvstore.client.publishing.publisher import BlockPublisher, PublishStats

__all__ = ["BlockPublisher", "PublishStats"]
