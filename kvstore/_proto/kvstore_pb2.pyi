from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STATUS_RESERVED: _ClassVar[PutStatus]
    PUT_STATUS_PRESENT: _ClassVar[PutStatus]
    PUT_STATUS_IN_FLIGHT: _ClassVar[PutStatus]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STATUS_RESERVED: PutStatus
PUT_STATUS_PRESENT: PutStatus
PUT_STATUS_IN_FLIGHT: PutStatus

class Namespace(_message.Message):
    __slots__ = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "tenant_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    tenant_salt: bytes
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., tenant_salt: _Optional[bytes] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("num_matched", "tiers")
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_matched: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, num_matched: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "parent_keys", "chain_depth", "chain_group")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_GROUP_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_keys: _containers.RepeatedScalarFieldContainer[bytes]
    chain_depth: int
    chain_group: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_keys: _Optional[_Iterable[bytes]] = ..., chain_depth: _Optional[int] = ..., chain_group: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "statuses")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    statuses: _containers.RepeatedScalarFieldContainer[PutStatus]
    def __init__(self, reservation_id: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[PutStatus, str]]] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("reservation_id", "index", "offset", "data")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    index: int
    offset: int
    data: bytes
    def __init__(self, reservation_id: _Optional[int] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_committed",)
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    def __init__(self, num_committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("found", "block_bytes", "checksums")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    block_bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., block_bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: GetChunk
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[_Union[GetChunk, _Mapping]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_blocks", "hits", "bytes_read", "bytes_written", "hit_tokens")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    bytes_read: int
    bytes_written: int
    hit_tokens: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., hit_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "num_namespaces", "num_reservations", "num_leases", "hits", "misses", "evictions", "blocks_committed", "bytes_written", "bytes_read", "checksum_failures", "expired_reservations", "expired_leases", "tiers", "miss_tokens", "demotions", "promotions", "drops", "ssd_write_failures")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    SSD_WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_namespaces: int
    num_reservations: int
    num_leases: int
    hits: int
    misses: int
    evictions: int
    blocks_committed: int
    bytes_written: int
    bytes_read: int
    checksum_failures: int
    expired_reservations: int
    expired_leases: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    miss_tokens: int
    demotions: int
    promotions: int
    drops: int
    ssd_write_failures: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_namespaces: _Optional[int] = ..., num_reservations: _Optional[int] = ..., num_leases: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., blocks_committed: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., expired_reservations: _Optional[int] = ..., expired_leases: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., miss_tokens: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., drops: _Optional[int] = ..., ssd_write_failures: _Optional[int] = ...) -> None: ...

class DataPlaneInfoRequest(_message.Message):
    __slots__ = ("transport", "client_address")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    client_address: bytes
    def __init__(self, transport: _Optional[str] = ..., client_address: _Optional[bytes] = ...) -> None: ...

class DataPlaneInfoResponse(_message.Message):
    __slots__ = ("transport", "server_address", "client_id", "connection_secret")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_SECRET_FIELD_NUMBER: _ClassVar[int]
    transport: str
    server_address: bytes
    client_id: int
    connection_secret: bytes
    def __init__(self, transport: _Optional[str] = ..., server_address: _Optional[bytes] = ..., client_id: _Optional[int] = ..., connection_secret: _Optional[bytes] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "chain_depth", "chain_group")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_GROUP_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    chain_depth: int
    chain_group: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., chain_depth: _Optional[int] = ..., chain_group: _Optional[bytes] = ...) -> None: ...

class PoolNode(_message.Message):
    __slots__ = ("node_id", "addresses", "capacity", "held")
    class AddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CapacityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HeldEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    addresses: _containers.ScalarMap[str, str]
    capacity: _containers.ScalarMap[str, int]
    held: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., addresses: _Optional[_Mapping[str, str]] = ..., capacity: _Optional[_Mapping[str, int]] = ..., held: _Optional[_Mapping[str, int]] = ...) -> None: ...

class BlockHolders(_message.Message):
    __slots__ = ("nodes", "tiers")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, nodes: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("nodes", "blocks", "degraded")
    NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[PoolNode]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    degraded: bool
    def __init__(self, nodes: _Optional[_Iterable[_Union[PoolNode, _Mapping]]] = ..., blocks: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ..., degraded: _Optional[bool] = ...) -> None: ...

class PoolStatusRequest(_message.Message):
    __slots__ = ("sample_blocks",)
    SAMPLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sample_blocks: int
    def __init__(self, sample_blocks: _Optional[int] = ...) -> None: ...

class PoolStatusResponse(_message.Message):
    __slots__ = ("in_pool", "node_id", "generation", "redis_ok", "fenced", "members", "num_published", "num_pending", "last_error", "rebuild_seconds", "num_locates", "num_locate_rounds", "holders_sampled")
    class HoldersSampledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    IN_POOL_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REDIS_OK_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    REBUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCATES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCATE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    in_pool: bool
    node_id: str
    generation: str
    redis_ok: bool
    fenced: bool
    members: _containers.RepeatedCompositeFieldContainer[PoolNode]
    num_published: int
    num_pending: int
    last_error: str
    rebuild_seconds: float
    num_locates: int
    num_locate_rounds: int
    holders_sampled: _containers.ScalarMap[int, int]
    def __init__(self, in_pool: _Optional[bool] = ..., node_id: _Optional[str] = ..., generation: _Optional[str] = ..., redis_ok: _Optional[bool] = ..., fenced: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[PoolNode, _Mapping]]] = ..., num_published: _Optional[int] = ..., num_pending: _Optional[int] = ..., last_error: _Optional[str] = ..., rebuild_seconds: _Optional[float] = ..., num_locates: _Optional[int] = ..., num_locate_rounds: _Optional[int] = ..., holders_sampled: _Optional[_Mapping[int, int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "max_tokens", "temperature", "seed", "stop_token_ids", "return_logits", "num_published_tokens", "prefetch")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_logits: bool
    num_published_tokens: int
    prefetch: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., return_logits: _Optional[bool] = ..., num_published_tokens: _Optional[int] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class GenerateUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "local_cached_tokens", "store_cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    local_cached_tokens: int
    store_cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., local_cached_tokens: _Optional[int] = ..., store_cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateMetrics(_message.Message):
    __slots__ = ("ttft_s", "tpot_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tpot_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "usage", "metrics", "logits", "num_published_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: GenerateUsage
    metrics: GenerateMetrics
    logits: bytes
    num_published_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[GenerateUsage, _Mapping]] = ..., metrics: _Optional[_Union[GenerateMetrics, _Mapping]] = ..., logits: _Optional[bytes] = ..., num_published_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_free_pages", "num_pages", "num_cached_blocks", "block_tokens", "store_connected", "num_store_loaded_blocks", "bytes_loaded", "num_published_blocks", "num_dropped_blocks", "num_pending_blocks", "role")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_free_pages: int
    num_pages: int
    num_cached_blocks: int
    block_tokens: int
    store_connected: bool
    num_store_loaded_blocks: int
    bytes_loaded: int
    num_published_blocks: int
    num_dropped_blocks: int
    num_pending_blocks: int
    role: str
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., block_tokens: _Optional[int] = ..., store_connected: _Optional[bool] = ..., num_store_loaded_blocks: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., num_published_blocks: _Optional[int] = ..., num_dropped_blocks: _Optional[int] = ..., num_pending_blocks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt", "max_tokens", "temperature", "seed", "ttft_slo_s", "tbt_slo_ms")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    ttft_slo_s: float
    tbt_slo_ms: float
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., ttft_slo_s: _Optional[float] = ..., tbt_slo_ms: _Optional[float] = ...) -> None: ...

class CompleteUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "prefill_engine", "decode_engine", "ttft_s", "predicted_ttft_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: CompleteUsage
    prefill_engine: int
    decode_engine: int
    ttft_s: float
    predicted_ttft_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[CompleteUsage, _Mapping]] = ..., prefill_engine: _Optional[int] = ..., decode_engine: _Optional[int] = ..., ttft_s: _Optional[float] = ..., predicted_ttft_s: _Optional[float] = ...) -> None: ...
