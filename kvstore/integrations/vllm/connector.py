"""vLLM KV connector: kvstore as vLLM's external prefix cache.

Enable it with one setting (see docs/vllm.md)::

    kv_transfer_config={
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvstore.address": "127.0.0.1:50051"},
    }

Scheduler side: hashes each prompt's full blocks into kvstore keys (namespace: model,
KV layout, block size; the request's `cache_salt` as tenant salt), asks the store for the
longest stored prefix and plans loads and saves. Worker side: loads planned blocks into
vLLM's paged cache (`loader.BlockLoader`: its fixed costs, the data-plane connection
and a touched staging pool, are paid at start-up; where the layout allows, straight into
the pages, layer by layer while the forward pass runs, `layer_load`; a load's phases
are logged at debug level, `event=load_phases`, and totalled at shutdown, `event=load_stats`)
and publishes newly computed prompt blocks
after it through `kvstore.client.publishing.BlockPublisher`: one copy into a bounded pool of host
staging blocks, then a background thread puts them. When the pool is full, blocks are
dropped (counted, logged as `event=save_dropped`, and totalled at shutdown as
`event=publish_stats`), and a chain cut by a drop is not continued. A block that cannot be
loaded is reported to vLLM, which recomputes it; only a fully received prefix counts
(`loaded_prefix_len`), and the model never reads a block the connector did not fill.

On a pool (`kvstore.pool`: `kvstore.address` names several nodes, the first beside this
engine), the scheduler matches through `PoolClient`, a load some of whose blocks are on
other nodes is read by it through the staging pool (`BlockTransfer.remote`), and saves are
placed over the pool's nodes with their chain positions.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from kvstore.client.publishing import BlockPublisher
from kvstore.errors import KVStoreError
from kvstore.integrations.load_phases import LoadResult, PhaseClock, PhaseTotals
from kvstore.integrations.vllm.blocks import PagedBlocks
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.layer_load import LayerLoad
from kvstore.integrations.vllm.loader import BlockLoader
from kvstore.integrations.vllm.log_routing import CONNECTOR_LOG, route_through_vllm
from kvstore.integrations.vllm.namespace import namespace_for
from kvstore.integrations.vllm.plan import BlockTransfer, RequestBlocks, loadable_prefix_len
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(CONNECTOR_LOG)
WARM_UP_MODEL_ID = "kvstore/warm-up"  # the namespace of start-up transfers, never a prompt's


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as vLLM's external prefix cache (`kv_role` "kv_both")."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = ConnectorConfig.from_extra_config(extra)
        route_through_vllm(self.config.log_level)
        self.block_tokens = vllm_config.cache_config.block_size
        settings: dict[str, Any] = {
            "transport": self.config.transport,
            "auth_token": self.config.auth_token(),
            "tls_ca": self.config.tls_ca,
        }
        # With a pool: the node beside the engine through the pool client, which reads
        # and puts what it does not hold.
        self._pool: PoolClient | None = None
        if self.config.pool:
            seeds = self.config.seeds
            self._pool = PoolClient(seeds, read_deadline_s=self.config.timeout_s, **settings)
            self._client = self._pool.node(seeds[0])
        else:
            self._client = Client(self.config.address, timeout_s=self.config.timeout_s, **settings)
        self._pool_namespaces: set[bytes] = set()  # worker: registered with the pool client
        # Scheduler state.
        self._namespaces: dict[str, Namespace] = {}  # cache_salt -> registered namespace
        self._requests: dict[str, RequestBlocks] = {}
        self._pending_loads: dict[str, int] = {}  # req_id -> external tokens to load
        # Worker state.
        self._paged: PagedBlocks | None = None
        self._loader: BlockLoader | None = None
        self._failed_block_ids: set[int] = set()
        self._layer_index: dict[str, int] = {}  # layer name -> its part of a store block
        self._layer_loads: list[LayerLoad] = []  # this step's loads still landing
        self._publisher: BlockPublisher | None = None
        self._load_totals = PhaseTotals()
        if role == KVConnectorRole.SCHEDULER:
            self._require_recompute_on_failure()
            self._namespace(None)  # the store's first answer, before the first request

    def _require_recompute_on_failure(self) -> None:
        # The store is a cache: a block it cannot deliver is recomputed, never fatal.
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("event=load_failure_policy policy=recompute")

    # -- scheduler side ----------------------------------------------------------------

    def _namespace(self, salt: str | None) -> Namespace | None:
        """The registered namespace of `salt`; None while the store is unreachable."""
        key = salt or ""
        if key not in self._namespaces:
            ns = namespace_for(self._vllm_config, self.config.model_id, salt)
            try:
                (self._pool or self._client).register_namespace(ns)
            except KVStoreError as exc:
                log.warning("event=register_failed error=%s", type(exc).__name__)
                return None
            self._namespaces[key] = ns
        return self._namespaces[key]

    def _blocks_of(self, request: Request) -> RequestBlocks | None:
        if request.request_id in self._requests:
            return self._requests[request.request_id]
        ns = self._namespace(request.cache_salt)
        if ns is None:
            return None
        tokens = request.prompt_token_ids or []
        blocks = RequestBlocks.from_prompt(request.request_id, ns, tokens)
        self._requests[request.request_id] = blocks
        return blocks

    def _num_matched_blocks(self, blocks: RequestBlocks, num_loadable: int) -> int:
        """The stored prefix of the loadable blocks; notes how much of it is on the node
        beside the engine (`RequestBlocks.num_home`)."""
        keys = blocks.keys[:num_loadable]
        if not keys:
            return 0
        if self._pool is not None:  # never raises: what fails is a miss
            matched, blocks.num_home = self._pool.match_from_home(blocks.namespace.id, keys)
            return matched.num_matched
        try:
            blocks.num_home = self._client.match(blocks.namespace.id, keys).num_matched
        except KVStoreError as exc:
            log.warning("event=match_failed req=%s error=%s", blocks.req_id, type(exc).__name__)
            return 0
        return blocks.num_home

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` the store holds: whole blocks of the longest
        stored prefix, short of the last prompt token. Changes nothing in the store."""
        clock = PhaseClock()
        blocks = self._blocks_of(request)  # namespace (first of its salt) and keys
        clock.lap("keys")
        if blocks is None:
            return 0, False
        num_prompt = len(request.prompt_token_ids or [])
        num_loadable = loadable_prefix_len(num_prompt, self.block_tokens) // self.block_tokens
        if num_loadable * self.block_tokens <= num_computed_tokens:
            return 0, False
        num_matched = self._num_matched_blocks(blocks, num_loadable)
        clock.lap("match")
        phases = clock.done(num_matched, 0)
        log.debug("event=match_phases req=%s %s", request.request_id, phases.log_fields())
        return max(num_matched * self.block_tokens - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            blocks = self._requests.get(new.req_id)
            if blocks is None:
                continue
            blocks.block_ids = list(new.block_ids[0])
            num_scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_request(meta, blocks, new.num_computed_tokens, num_scheduled)
        self._plan_running(meta, scheduler_output)
        self._pending_loads.clear()
        return meta

    def _plan_running(self, meta: KVStoreConnectorMetadata, out: SchedulerOutput) -> None:
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = self._requests.get(req_id)
            if blocks is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                blocks.block_ids = list(new_ids[0]) if new_ids is not None else []
                blocks.num_saved_blocks = 0
            elif new_ids is not None:
                blocks.block_ids.extend(new_ids[0])
            num_scheduled = out.num_scheduled_tokens.get(req_id, 0)
            self._plan_request(meta, blocks, cached.num_computed_tokens[i], num_scheduled)

    def _plan_request(
        self,
        meta: KVStoreConnectorMetadata,
        blocks: RequestBlocks,
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        """Loads the external hit (if any), then saves what this step completes."""
        stop = num_computed // self.block_tokens
        num_external = self._pending_loads.get(blocks.req_id, 0)
        if num_external:
            meta.loads.append(blocks.load(stop - num_external // self.block_tokens, stop))
        # Blocks before this step's first token are cached locally or loaded: in the store.
        blocks.num_saved_blocks = max(blocks.num_saved_blocks, stop)
        if self.config.save:
            save = blocks.take_saves(num_computed + num_scheduled)
            if save is not None:
                meta.saves.append(save)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy blocks out during the step, so vLLM may free them at once.
        self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        paged = self._paged = PagedBlocks(list(kv_caches.values()), num_blocks)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._warm_up_loads(paged)
        if self.config.save:
            block_shape = (len(paged.layers), paged.layer_elems)
            is_cuda = paged.layers[0].is_cuda
            self._publisher = BlockPublisher(
                None, block_shape, paged.dtype, self.config.publish_buffers, pin_memory=is_cuda
            )
        log.info(
            "event=kv_caches_registered layers=%d block_bytes=%d num_blocks=%d publish_buffers=%d",
            len(kv_caches),
            paged.block_bytes,
            num_blocks,
            self.config.publish_buffers if self._publisher else 0,
        )

    def _warm_up_loads(self, paged: PagedBlocks) -> None:
        """Pays a load's fixed costs now: the data plane and the staging pool."""
        config = self.config
        self._loader = BlockLoader(
            self._client,
            paged,
            config.load_buffers,
            config.load_by_layer,
            config.share_pages,
            self._pool,
        )
        warm_up = namespace_for(self._vllm_config, WARM_UP_MODEL_ID, None)
        try:
            self._client.register_namespace(warm_up)
            phases = self._loader.warm_up(warm_up.id)
        except KVStoreError as exc:  # unreachable now: the first load connects
            log.warning("event=warm_up_failed error=%s", type(exc).__name__)
            return
        shared = self._loader.shared_bytes
        log.info("event=load_warm_up %s shared_bytes=%d", phases.log_fields(), shared)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts every planned load: layer by layer beside the forward pass where the
        layout allows (`wait_for_layer_load` holds each layer's attention until its layer
        is in), else before the forward pass."""
        self._finish_layer_loads()  # a step whose loads nobody finished (none expected)
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for load in meta.loads:
            assert self._loader is not None, "register_kv_caches was not called"
            self._register_with_pool(load)
            layer_load = self._loader.start_layers(load)
            if layer_load is not None:
                self._layer_loads.append(layer_load)
            else:
                mode = "remote" if self._pool is not None and load.remote else "staged"
                self._account(load, self._loader.load(load), mode)

    def _register_with_pool(self, transfer: BlockTransfer) -> None:
        """Tells the pool client `transfer`'s namespace, so that it can name it to every
        node it reads from or puts to (once per namespace; a failure only costs misses)."""
        if self._pool is None or transfer.namespace_id in self._pool_namespaces:
            return
        try:
            self._pool.register_namespace(transfer.namespace)
        except KVStoreError as exc:
            log.warning("event=register_failed error=%s", type(exc).__name__)
            return
        self._pool_namespaces.add(transfer.namespace_id)

    def _finish_layer_loads(self) -> None:
        loads, self._layer_loads = self._layer_loads, []
        for layer_load in loads:
            self._account(layer_load.transfer, layer_load.finish(), "by_layer")

    def _account(self, load: BlockTransfer, result: LoadResult, mode: str) -> None:
        if result.error is not None:
            log.warning(
                "event=load_failed req=%s mode=%s error=%s detail=%r",
                load.req_id,
                mode,
                type(result.error).__name__,
                str(result.error)[:200],
            )
        self._load_totals.add(result.phases)
        fields = result.phases.log_fields()
        log.debug("event=load_phases req=%s mode=%s %s", load.req_id, mode, fields)
        if result.num_loaded < len(load.keys):
            # A chain with a hole is unusable past it: vLLM recomputes from the first miss.
            self._failed_block_ids.update(load.block_ids[result.num_loaded :])
            log.warning(
                "event=load_incomplete req=%s loaded=%d failed=%d",
                load.req_id,
                result.num_loaded,
                len(load.keys) - result.num_loaded,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:  # a layer of no registered KV cache: nothing of it is loaded
            return
        for layer_load in self._layer_loads:
            layer_load.wait_layer(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are copied out once, for all layers, in wait_for_save

    def wait_for_save(self) -> None:
        """Copies this step's completed blocks into staging and publishes them in the
        background; blocks beyond the free staging are dropped (a future miss)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for save in meta.saves:
            self._register_with_pool(save)
            self._offer(save)

    def _offer(self, save: BlockTransfer) -> None:
        paged, publisher = self._paged, self._publisher
        assert paged is not None and publisher is not None, "register_kv_caches was not called"

        def read_blocks(start: int, outs: torch.Tensor) -> None:
            paged.gather_into(save.block_ids[start : start + len(outs)], outs)

        put = functools.partial(self._put, save)
        num_staged = publisher.offer_batch(save.keys, read_blocks, save.parent, put)
        if num_staged < len(save.keys):
            log.warning(
                "event=save_dropped req=%s blocks=%d staged=%d dropped_total=%d",
                save.req_id,
                len(save.keys),
                num_staged,
                publisher.stats().num_dropped_blocks,
            )

    def _put(
        self,
        save: BlockTransfer,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor] | torch.Tensor,
        parent: bytes | None,
    ) -> None:
        """The publisher's put of (a staged prefix of) `save`; raises what the store raised."""
        buffers: Any
        if isinstance(blocks, torch.Tensor):  # one slice of the publisher's ring
            buffers = PagedBlocks.as_rows(blocks)
        else:
            buffers = [PagedBlocks.as_buffer(block) for block in blocks]
        if self._pool is not None:  # placed over the pool's nodes
            result = self._pool.put_chain(save.namespace_id, keys, buffers, parent, save.position)
        else:
            result = self._client.put_chain(save.namespace_id, keys, buffers, parent)
        log.debug("event=saved req=%s blocks=%d result=%s", save.req_id, len(keys), result)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """After the forward pass: the blocks of this step's loads that did not arrive
        whole (vLLM drops the step's output of their requests and recomputes them)."""
        self._finish_layer_loads()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        """Finishes the loads and queued publishes, then closes the store connection."""
        self._finish_layer_loads()
        if self._load_totals.num_loads:
            log.info("event=load_stats %s", self._load_totals.log_fields())
        if self._publisher is not None:
            self._publisher.close()
            stats = self._publisher.stats()
            log.info(
                "event=publish_stats published=%d dropped=%d failed=%d",
                stats.num_published_blocks,
                stats.num_dropped_blocks,
                stats.num_failed_blocks,
            )
        if self._pool is not None:
            self._pool.close()  # its node clients too
        else:
            self._client.close()
