"""Block keys: chained prefix hashes over full blocks of prompt tokens.

``key_0 = H(ns || tokens[0:B])`` and ``key_i = H(key_{i-1} || tokens[iB:(i+1)B])`` with
``H = blake2b(digest_size=32)``, tokens as little-endian uint32 and ``ns`` the namespace id:
the hash of a canonical encoding of model id, KV layout and tenant salt. Keys depend on
nothing but these inputs, so every process, machine and Python version agrees on them.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.errors import InvalidArgumentError

KEY_BYTES = 32
_NAMESPACE_VERSION = "kvstore-ns-v1"
_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_UINT32_TYPECODE = next(code for code in "IL" if array.array(code).itemsize == 4)
# Blocks are grouped in runs of this many along their chain, each group named by its first
# key: a mirror of the index keeps a group together (one Redis Cluster slot), a chain's
# lookup reads one group per run, and a pool places a chain on its nodes in pieces that
# never straddle a group. Every node and client of a pool uses this value.
CHAIN_GROUP_BLOCKS = 32
MAX_CHAIN_DEPTH = 1 << 24  # blocks along one chain a stated position may name


class ChainPosition(NamedTuple):
    """Where a block whose parent is held on another node of a pool sits in its chain:
    `depth` blocks come before it, and `group` is the first key of its chain group (the
    block's own key where `depth` is a multiple of `CHAIN_GROUP_BLOCKS`)."""

    depth: int
    group: bytes

    @classmethod
    def of(
        cls, keys: Sequence[bytes], start: int, first: ChainPosition | None = None
    ) -> ChainPosition | None:
        """The place of `keys[start]`, `keys` being consecutive blocks of one chain the
        first of which sits at `first` (None: at the chain's root); None at the root."""
        depth = start + (0 if first is None else first.depth)
        if depth == 0:
            return None
        opened = start - depth % CHAIN_GROUP_BLOCKS  # where its group opened, in `keys`
        if opened < 0:  # before keys[0]: the group of the first
            assert first is not None
            return cls(depth, first.group)
        return cls(depth, keys[opened])

    def check(self, key: bytes) -> None:
        """Raises `InvalidArgumentError` unless this is a position block `key` can have."""
        if not 0 < self.depth < MAX_CHAIN_DEPTH:
            raise InvalidArgumentError(f"a chain depth of {self.depth} is out of range")
        if len(self.group) != KEY_BYTES:
            raise InvalidArgumentError(f"a chain group is named by a key of {KEY_BYTES} bytes")
        if (self.depth % CHAIN_GROUP_BLOCKS == 0) != (self.group == key):
            raise InvalidArgumentError(
                "a block opens its chain group exactly where its depth is a multiple of "
                f"{CHAIN_GROUP_BLOCKS}, and names itself as the group's first key then"
            )


def chain_groups(keys: Sequence[bytes], position: ChainPosition | None = None) -> list[bytes]:
    """The chain group (its first key) of each of `keys`, consecutive blocks of one chain
    the first of which sits at `position` (None: at the chain's root)."""
    if not keys:
        return []
    depth, group = (0, keys[0]) if position is None else position
    groups = []
    for i, key in enumerate(keys):
        if (depth + i) % CHAIN_GROUP_BLOCKS == 0:
            group = key
        groups.append(group)
    return groups


@dataclass(frozen=True)
class KVLayout:
    """Shape of one block: K and V for every layer over `block_tokens` tokens."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise InvalidArgumentError(
                f"unknown dtype {self.dtype!r}; known: {sorted(_DTYPE_BYTES)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V, all layers, all KV heads."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_tokens * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Namespace:
    """Everything a block's bytes depend on besides its tokens, plus the tenant's salt.

    Blocks of two namespaces never share a key: a different model, KV layout or salt gives
    different keys for the same tokens, so one tenant cannot probe another's prompts.
    """

    model_id: str
    layout: KVLayout
    tenant_salt: bytes = b""

    def __post_init__(self) -> None:
        if not self.model_id or "\n" in self.model_id:
            raise InvalidArgumentError("model_id must be non-empty and on one line")
        if not isinstance(self.tenant_salt, bytes):
            raise InvalidArgumentError("tenant_salt must be bytes")

    def encode(self) -> bytes:
        """Canonical encoding: one field per line, fixed order, salt in hex."""
        lay = self.layout
        fields = (
            _NAMESPACE_VERSION,
            f"model_id={self.model_id}",
            f"dtype={lay.dtype}",
            f"num_layers={lay.num_layers}",
            f"num_kv_heads={lay.num_kv_heads}",
            f"head_dim={lay.head_dim}",
            f"block_tokens={lay.block_tokens}",
            f"tenant_salt={self.tenant_salt.hex()}",
        )
        return "\n".join(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> Namespace:
        """Inverse of `encode`; raises InvalidArgumentError on anything else."""
        lines = data.decode(errors="replace").split("\n")
        if not lines or lines[0] != _NAMESPACE_VERSION:
            raise InvalidArgumentError("not an encoded namespace")
        try:
            f = dict(line.split("=", 1) for line in lines[1:])
            layout = KVLayout(
                f["dtype"],
                int(f["num_layers"]),
                int(f["num_kv_heads"]),
                int(f["head_dim"]),
                int(f["block_tokens"]),
            )
            return cls(f["model_id"], layout, bytes.fromhex(f["tenant_salt"]))
        except (KeyError, ValueError) as exc:
            raise InvalidArgumentError(f"malformed namespace encoding: {exc}") from exc

    @property
    def id(self) -> bytes:
        """32-byte namespace id, the seed of every key chain in this namespace."""
        return hashlib.blake2b(self.encode(), digest_size=KEY_BYTES).digest()

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian uint32 encoding of token ids; rejects ids outside [0, 2**32)."""
    if isinstance(tokens, list | tuple):
        fast = _int_sequence_to_bytes(tokens)
        if fast is not None:
            return fast
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidArgumentError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def _int_sequence_to_bytes(tokens: list[int] | tuple[int, ...]) -> bytes | None:
    """Fast path for Python ints (3x quicker than numpy): None when any id is not a uint32.

    ``array('I')`` range-checks every item and refuses floats and strings; on refusal the caller
    falls back to numpy, which names the problem. A leading bool also goes to numpy, which
    rejects an all-bool list as it always has.
    """
    if tokens and isinstance(tokens[0], bool):
        return None
    try:
        arr = array.array(_UINT32_TYPECODE, tokens)
    except (TypeError, OverflowError):
        return None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def block_keys(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained keys of every full block of `tokens`; a trailing partial block gets none.

    Args:
        namespace: model, layout and tenant the blocks belong to.
        tokens: token ids; only the first ``len(tokens) // block_tokens`` blocks are keyed.
        parent: key of the block just before `tokens[0]`, to continue an existing chain.
    """
    data = memoryview(tokens_to_bytes(tokens))
    block_bytes = namespace.block_tokens * 4
    prev = namespace.id if parent is None else parent
    if len(prev) != KEY_BYTES:
        raise InvalidArgumentError(f"parent key must be {KEY_BYTES} bytes, got {len(prev)}")
    keys = []
    # Copying a fresh hasher is cheaper than constructing one per block; same digest.
    empty = hashlib.blake2b(digest_size=KEY_BYTES)
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = empty.copy()
        h.update(prev)
        h.update(data[start : start + block_bytes])
        prev = h.digest()
        keys.append(prev)
    return keys
