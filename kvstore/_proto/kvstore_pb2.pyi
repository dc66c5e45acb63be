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
    __slots__ = ("namespace_id", "keys", "parent_keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

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
    __slots__ = ("found", "block_bytes")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    block_bytes: int
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_blocks", "hits", "bytes_read", "bytes_written")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    bytes_read: int
    bytes_written: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "num_namespaces", "num_reservations", "num_leases", "hits", "misses", "evictions", "blocks_committed", "bytes_written", "bytes_read", "checksum_failures", "expired_reservations", "expired_leases", "tiers")
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
    def __init__(self, num_blocks: _Optional[int] = ..., num_namespaces: _Optional[int] = ..., num_reservations: _Optional[int] = ..., num_leases: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., blocks_committed: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., expired_reservations: _Optional[int] = ..., expired_leases: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ...) -> None: ...

class DataPlaneInfoRequest(_message.Message):
    __slots__ = ("transport", "client_address")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    client_address: bytes
    def __init__(self, transport: _Optional[str] = ..., client_address: _Optional[bytes] = ...) -> None: ...

class DataPlaneInfoResponse(_message.Message):
    __slots__ = ("transport", "server_address", "client_id")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    transport: str
    server_address: bytes
    client_id: int
    def __init__(self, transport: _Optional[str] = ..., server_address: _Optional[bytes] = ..., client_id: _Optional[int] = ...) -> None: ...
