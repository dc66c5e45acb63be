"""The settings of one store node: tier capacities, policies, watermarks, limits.

Each field is also a `kvstore serve` flag, an environment variable and a TOML key
(`kvstore.config`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from kvstore import errors
from kvstore.config import option, parse_bytes
from kvstore.limits import LAYOUT_FIELDS, NamespaceLimits
from kvstore.store.eviction import POLICIES
from kvstore.store.tiers.dram import DEFAULT_SLAB_BYTES
from kvstore.store.tiers.hbm import is_cuda_available

_LIMITS = (
    "max_batch_keys",
    "max_namespaces",
    "max_model_id_bytes",
    "max_dtype_bytes",
    "max_tenant_salt_bytes",
    *(f"max_{name}" for name in LAYOUT_FIELDS),
    "max_reservations_per_client",
    "max_reservations",
    "max_leases_per_client",
    "max_leases",
)


@dataclass(frozen=True)
class StoreConfig:
    """Capacity and limits of one store node."""

    dram_bytes: int = option(
        1 << 30, "DRAM tier capacity (bytes, or with a unit: 256MiB)", parse_bytes
    )
    slab_bytes: int = option(
        DEFAULT_SLAB_BYTES, "DRAM slab size; the largest block it holds", parse_bytes
    )
    policy: str = option("prefix-2q", f"eviction policy, one of {sorted(POLICIES)}")
    max_batch_keys: int = option(4096, "most keys one call may carry")
    max_namespaces: int = option(1024, "most namespaces the node registers")
    max_model_id_bytes: int = option(256, "longest model id of a namespace (UTF-8 bytes)")
    max_dtype_bytes: int = option(32, "longest dtype name of a namespace (bytes)")
    max_tenant_salt_bytes: int = option(64, "longest tenant salt of a namespace (bytes)")
    max_num_layers: int = option(1024, "most layers of a namespace's KV layout")
    max_num_kv_heads: int = option(1024, "most KV heads of a namespace's KV layout")
    max_head_dim: int = option(4096, "largest head_dim of a namespace's KV layout")
    max_block_tokens: int = option(16384, "most tokens per block of a namespace")
    max_reservations_per_client: int = option(
        1024, "most open reservations of one client (a gRPC peer; in process: one)"
    )
    max_reservations: int = option(16384, "most open reservations in all")
    max_leases_per_client: int = option(
        1024, "most open read leases of one client (a gRPC peer; in process: one)"
    )
    max_leases: int = option(16384, "most open read leases in all")
    reservation_timeout_s: float = option(30.0, "an uncommitted reservation is freed after this")
    lease_timeout_s: float = option(30.0, "a read lease a client did not release ends after this")
    verify_reads: bool = option(
        False, "also check DRAM blocks' checksums on every read (SSD reads always are)"
    )
    hbm_bytes: int = option(
        0, "HBM tier capacity (device copies of blocks read over UCX); 0: none", parse_bytes
    )
    hbm_device: str = option("cuda", "torch device of the HBM tier")
    ssd_path: str = option("", "directory of the SSD tier (LMDB); empty: no SSD tier")
    ssd_bytes: int = option(0, "SSD tier capacity", parse_bytes)
    ssd_policy: str = option("prefix-2q", "eviction policy of the SSD tier")
    ssd_sync: bool = option(False, "fsync each SSD transaction (survives power loss)")
    dram_high_watermark: float = option(0.95, "DRAM fill that starts demotion to SSD")
    dram_low_watermark: float = option(0.85, "DRAM fill that demotion stops at")
    ssd_high_watermark: float = option(1.0, "SSD fill that starts SSD eviction")
    ssd_low_watermark: float = option(0.98, "SSD fill that SSD eviction stops at")
    background_demotion: bool = option(True, "demote from a background thread, not inline")

    def __post_init__(self) -> None:
        if self.dram_bytes < 64:
            raise errors.InvalidArgumentError(f"dram_bytes too small: {self.dram_bytes}")
        if self.slab_bytes < 64:
            raise errors.InvalidArgumentError(f"slab_bytes too small: {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise errors.InvalidArgumentError(
                f"unknown policy {self.policy!r}; known: {sorted(POLICIES)}"
            )
        for name in _LIMITS:
            if getattr(self, name) < 1:
                raise errors.InvalidArgumentError(f"{name} must be >= 1")
        if self.reservation_timeout_s <= 0 or self.lease_timeout_s <= 0:
            raise errors.InvalidArgumentError("timeouts must be positive")
        if self.ssd_policy not in POLICIES:
            raise errors.InvalidArgumentError(f"unknown ssd_policy {self.ssd_policy!r}")
        if self.hbm_bytes < 0:
            raise errors.InvalidArgumentError(f"hbm_bytes must be >= 0, got {self.hbm_bytes}")
        if self.hbm_bytes and importlib.util.find_spec("torch") is None:
            raise errors.InvalidArgumentError("an HBM tier (hbm_bytes) needs torch")
        if self.hbm_bytes and self.hbm_device.startswith("cuda") and not is_cuda_available():
            raise errors.InvalidArgumentError("an HBM tier (hbm_bytes) needs torch with CUDA")
        if self.ssd_path and self.ssd_bytes <= 0:
            raise errors.InvalidArgumentError("an SSD tier (ssd_path) needs ssd_bytes > 0")
        for tier in ("dram", "ssd"):
            low, high = (
                getattr(self, f"{tier}_low_watermark"),
                getattr(self, f"{tier}_high_watermark"),
            )
            if not 0 < low <= high <= 1:
                raise errors.InvalidArgumentError(
                    f"{tier} watermarks need 0 < low <= high <= 1, got {low}, {high}"
                )

    @property
    def namespace_limits(self) -> NamespaceLimits:
        return NamespaceLimits(
            self.max_model_id_bytes,
            self.max_dtype_bytes,
            self.max_tenant_salt_bytes,
            {name: getattr(self, f"max_{name}") for name in LAYOUT_FIELDS},
        )
