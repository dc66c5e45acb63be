"""Namespaces: the registry of a store's namespaces, checked against the node's limits and,
with an SSD tier, kept beside the blocks so that a restarted store knows them again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.keys import Namespace
from kvstore.limits import LAYOUT_FIELDS

if TYPE_CHECKING:
    from kvstore.store_config import StoreConfig
    from kvstore.tiering import Tiering


class Namespaces:
    """Namespaces by id; every method runs under the store's lock but `validate`."""

    def __init__(self, config: StoreConfig, tiering: Tiering) -> None:
        self.config = config
        self._tiering = tiering
        self._by_id: dict[bytes, Namespace] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def load(self) -> None:
        """Registers the namespaces saved on SSD (none without an SSD tier)."""
        ssd = self._tiering.ssd
        for raw in ({} if ssd is None else ssd.load_meta()).values():
            ns = Namespace.decode(raw)
            self._by_id[ns.id] = ns

    def validate(self, namespace: Namespace) -> None:
        """Raises unless `namespace` fits the node's limits and its DRAM slabs."""
        lay = namespace.layout
        layout = {name: getattr(lay, name) for name in LAYOUT_FIELDS}
        limits = self.config.namespace_limits
        limits.check(namespace.model_id, lay.dtype, namespace.tenant_salt, layout)
        dram = self._tiering.dram
        if not dram.can_fit(namespace.block_bytes):
            raise errors.InvalidArgumentError(
                f"block of {namespace.block_bytes} bytes exceeds the slab size "
                f"({dram.slab_bytes} bytes)"
            )

    def register(self, namespace: Namespace) -> None:
        """Makes a validated `namespace` known; idempotent. Raises
        `TooManyNamespacesError` past `max_namespaces`, `StoreFullError` (registering
        nothing) when the SSD cannot store it."""
        if namespace.id in self._by_id:
            return
        if len(self._by_id) >= self.config.max_namespaces:
            raise errors.TooManyNamespacesError(
                f"the node has {len(self._by_id)} namespaces, the most allowed "
                f"(max_namespaces = {self.config.max_namespaces})"
            )
        self._tiering.save_meta(namespace.id, namespace.encode())
        self._by_id[namespace.id] = namespace

    def get(self, namespace_id: bytes) -> Namespace:
        try:
            return self._by_id[namespace_id]
        except KeyError:
            raise errors.UnknownNamespaceError(
                f"unknown namespace {namespace_id.hex()[:16]}...; register it first"
            ) from None
