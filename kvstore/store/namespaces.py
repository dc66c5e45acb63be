"""Namespaces: the registry of a store's namespaces, checked against the node's limits and,
with an SSD tier, kept beside the blocks so that a restarted store knows them again.

A namespace is filed under the id the store uses for it: its own `Namespace.id` on a node
without tenants, else the internal id its tenant's map gives it (`kvstore.tenancy`), with
the tenant that registered it. On SSD, a tenant's namespace is saved as `_TENANT_MAGIC`, the
tenant and the encoded namespace, one line each; an anonymous one as the encoded namespace
alone, as before tenants.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.auth import ANONYMOUS
from kvstore.keys import Namespace
from kvstore.limits import LAYOUT_FIELDS

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig
    from kvstore.store.tiering import Tiering


class Namespaces:
    """Namespaces by id; every method runs under the store's lock but `validate`."""

    def __init__(self, config: StoreConfig, tiering: Tiering) -> None:
        self.config = config
        self._tiering = tiering
        self._by_id: dict[bytes, Namespace] = {}
        self._tenant: dict[bytes, str] = {}  # id -> its tenant, but ANONYMOUS
        self._num_by_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._by_id)

    def load(self) -> None:
        """Registers the namespaces saved on SSD (none without an SSD tier)."""
        for name, raw in self._tiering.load_meta().items():
            tenant, ns = _decode(raw)
            self._file(name if tenant != ANONYMOUS else ns.id, ns, tenant)

    def validate(self, namespace: Namespace) -> None:
        """Raises unless `namespace` fits the node's limits and its DRAM slabs."""
        lay = namespace.layout
        layout = {name: getattr(lay, name) for name in LAYOUT_FIELDS}
        limits = self.config.namespace_limits
        limits.check(namespace.model_id, lay.dtype, namespace.tenant_salt, layout)
        if not self._tiering.fits_dram(namespace.block_bytes):
            raise errors.InvalidArgumentError(
                f"block of {namespace.block_bytes} bytes exceeds the slab size "
                f"({self._tiering.slab_bytes} bytes)"
            )

    def register(
        self,
        namespace: Namespace,
        namespace_id: bytes | None = None,
        tenant: str = ANONYMOUS,
        max_per_tenant: int | None = None,
    ) -> None:
        """Makes a validated `namespace` known as `namespace_id` (default its own id) of
        `tenant`; idempotent. Raises `TooManyNamespacesError` past `max_namespaces` (or the
        tenant's `max_per_tenant`), `StoreFullError` (registering nothing) when the SSD
        cannot store it."""
        nid = namespace.id if namespace_id is None else namespace_id
        if nid in self._by_id:
            return
        if len(self._by_id) >= self.config.max_namespaces:
            raise errors.TooManyNamespacesError(
                f"the node has {len(self._by_id)} namespaces, the most allowed "
                f"(max_namespaces = {self.config.max_namespaces})"
            )
        if max_per_tenant is not None and self._num_by_tenant[tenant] >= max_per_tenant:
            raise errors.TooManyNamespacesError(
                f"tenant {tenant} has {self._num_by_tenant[tenant]} namespaces, the most "
                f"allowed (max_namespaces_per_tenant = {max_per_tenant})"
            )
        self._tiering.save_meta(nid, _encode(namespace, tenant))
        self._file(nid, namespace, tenant)

    def tenant_of(self, namespace_id: bytes) -> str:
        """The tenant that registered `namespace_id` (ANONYMOUS for none)."""
        return self._tenant.get(namespace_id, ANONYMOUS)

    def num_of(self, tenant: str) -> int:
        """How many namespaces `tenant` registered."""
        return self._num_by_tenant[tenant]

    def __contains__(self, namespace_id: bytes) -> bool:
        return namespace_id in self._by_id

    def _file(self, namespace_id: bytes, namespace: Namespace, tenant: str) -> None:
        self._by_id[namespace_id] = namespace
        if tenant != ANONYMOUS:
            self._tenant[namespace_id] = tenant
        self._num_by_tenant[tenant] += 1

    def get(self, namespace_id: bytes) -> Namespace:
        try:
            return self._by_id[namespace_id]
        except KeyError:
            raise errors.UnknownNamespaceError(
                f"unknown namespace {namespace_id.hex()[:16]}...; register it first"
            ) from None


_TENANT_MAGIC = b"kvstore-tenant-namespace-v1"


def _encode(namespace: Namespace, tenant: str) -> bytes:
    if tenant == ANONYMOUS:
        return namespace.encode()
    return b"\n".join((_TENANT_MAGIC, tenant.encode(), namespace.encode()))


def _decode(raw: bytes) -> tuple[str, Namespace]:
    """(tenant, namespace) of a saved value."""
    if not raw.startswith(_TENANT_MAGIC + b"\n"):
        return ANONYMOUS, Namespace.decode(raw)
    _, tenant, encoded = raw.split(b"\n", 2)
    return tenant.decode(), Namespace.decode(encoded)
