"""The read-only view of a cluster that policies decide on; a simulator or a live front
provides it.

Everything here is a snapshot at `ClusterView.now_s`: reading changes nothing, and a
policy must not keep a view past its `decide` call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.conductor.cost_model import CostModel


class RunningSeq(NamedTuple):
    """A sequence decoding (or waiting for room) on a decode instance."""

    context_len: int  # prompt plus tokens generated so far
    generated: int  # output tokens generated so far
    is_waiting: bool = False  # arrived, but waits for KV room (holds none yet)


class IncomingSeq(NamedTuple):
    """A request sent to a decode instance that is still being prefilled."""

    arrival_s: float  # predicted time its KV reaches the decode instance
    input_len: int


class PrefillView(ABC):
    """One prefill instance: its FIFO queue of predicted work and its local prefix cache."""

    @abstractmethod
    def queued_s(self) -> float:
        """Predicted seconds until a request queued now would start (the work ahead)."""

    @abstractmethod
    def num_queued(self) -> int:
        """Requests queued or running on the instance."""

    @abstractmethod
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute (not cached) over the requests queued or running."""

    @abstractmethod
    def cached_prefix(self, hash_ids: Sequence[int]) -> int:
        """How many of `hash_ids`, from the first, the local cache holds."""

    def queued_prefix(self, hash_ids: Sequence[int]) -> int:
        """How many of `hash_ids`, from the first, the local cache will hold when a request
        queued now starts: held now, or in the prompt of a request queued or running ahead
        of it, which finishes first (FIFO) and leaves its blocks there.

        A view that cannot see its queue's prompts keeps this default, the cache now.
        """
        return self.cached_prefix(hash_ids)

    @property
    @abstractmethod
    def cache_capacity_blocks(self) -> int:
        """Blocks the local cache holds when full."""


class DecodeView(ABC):
    """One decode instance: what it decodes now and what is on its way to it."""

    @abstractmethod
    def running(self) -> Sequence[RunningSeq]:
        """Sequences decoding or waiting for KV room there."""

    @abstractmethod
    def incoming(self) -> Sequence[IncomingSeq]:
        """Requests routed there still in prefill or in transfer."""

    @abstractmethod
    def context_tokens(self) -> int:
        """KV tokens the running sequences hold now."""

    @property
    @abstractmethod
    def kv_capacity_tokens(self) -> int:
        """KV tokens the instance holds when full."""

    @property
    def refuses_when_busy(self) -> bool:
        """Whether a request whose KV arrives when the instance cannot decode it at once
        within the TBT objective is refused, its prefill thrown away (as Mooncake's decode
        instances do), rather than queued until there is room (as an engine's waiting
        queue does). A view that does not say queues."""
        return False


class ClusterView(ABC):
    """The cluster at one instant: instances, the global pool and the cost model."""

    @property
    @abstractmethod
    def now_s(self) -> float:
        """The time of the snapshot (seconds, the clock arrivals are stamped with)."""

    @property
    @abstractmethod
    def prefill(self) -> Sequence[PrefillView]:
        """Prefill instances, by index."""

    @property
    @abstractmethod
    def decode(self) -> Sequence[DecodeView]:
        """Decode instances, by index."""

    @property
    @abstractmethod
    def cost(self) -> CostModel:
        """The cost model predictions are made with."""

    @abstractmethod
    def pool_prefix(self, hash_ids: Sequence[int], start: int = 0) -> int:
        """How many of ``hash_ids[start:]``, from the first, the global pool holds."""

    @property
    def ttft_latency_s(self) -> float:
        """What a request's first token takes beyond its queue and its prefill's plan (the
        calls there and back): the view's measurement, 0 where it measures none."""
        return 0.0

    def handoff_s(self, input_len: int, compute_s: float) -> float:
        """From a request's first token (its prefill's end) to its KV on its decode
        instance: the cost model's (`CostModel.handoff_s`) unless the view measures it."""
        return self.cost.handoff_s(input_len, compute_s)
