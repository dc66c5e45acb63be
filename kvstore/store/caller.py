"""Callers: who a store call is for, resolved once at the edge (an RPC, a data-plane frame).

A `Caller` names the client that owns what a call opens (its leases and reservations count
against that owner), the tenant its blocks, quotas and counters are charged to, and how the
namespace ids it sends map to the ids the store files them under. The store defines only
what it needs of that map (`NamespaceMap`); the node's tenancy gives each tenant one
(`kvstore.tenancy`). `LOCAL` is an in-process caller on a node without tenants: ids are its
own, and everything counts against `LOCAL_OWNER`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstore.auth import ANONYMOUS
from kvstore.limits import LOCAL_OWNER

IsRegistered = Callable[[bytes], bool]


class NamespaceMap(Protocol):
    """A caller's namespace ids -> the ids the store files them under."""

    def register_id(self, namespace_id: bytes) -> bytes:
        """The id a namespace the caller registers is filed under."""
        ...

    def read_ids(
        self, namespace_id: bytes, is_registered: IsRegistered
    ) -> tuple[bytes, bytes | None]:
        """Where a read of `namespace_id` looks first, and where next, block by block
        (None: nowhere else); raises `UnknownNamespaceError` where it may read nothing."""
        ...

    def write_id(self, namespace_id: bytes, is_registered: IsRegistered) -> bytes:
        """Where a write or remove of `namespace_id` acts; raises where it may not."""
        ...


class OwnIds:
    """Every id names itself: a node without tenants."""

    def register_id(self, namespace_id: bytes) -> bytes:
        return namespace_id

    def read_ids(
        self, namespace_id: bytes, is_registered: IsRegistered
    ) -> tuple[bytes, bytes | None]:
        return namespace_id, None

    def write_id(self, namespace_id: bytes, is_registered: IsRegistered) -> bytes:
        return namespace_id


OWN_IDS = OwnIds()


@dataclass(frozen=True)
class Caller:
    """Who a store call is for.

    Attributes:
        owner: the client its leases and reservations belong to and count against
            (`kvstore.limits`); to any other owner they are unknown.
        tenant: whose blocks these are: tier quotas, per-tenant counters and stats.
        namespaces: how the namespace ids it sends map to the store's.
        max_namespaces: how many namespaces its tenant may register (None: no limit).
        sees_node: its `stats` are the node's; else its tenant's own.
    """

    owner: str = LOCAL_OWNER
    tenant: str = ANONYMOUS
    namespaces: NamespaceMap = OWN_IDS
    max_namespaces: int | None = None
    sees_node: bool = True


LOCAL = Caller()
