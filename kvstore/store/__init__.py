"""The store core: one node's blocks in its tiers, behind one lock.

`Store` (store.py) is the API; beneath it the block index, reservations and leases, the
chain rules, namespaces, tiering over the tiers (`tiers/`: HBM, DRAM, SSD) with their
eviction policies (`eviction/`), and per-tenant quotas. Nothing here knows gRPC, tenants'
tokens or the data planes: the node (`kvstore.node`) calls in with a resolved caller.
"""

from kvstore.store.config import StoreConfig
from kvstore.store.store import Clock, Lease, Reservation, Store

__all__ = ["Clock", "Lease", "Reservation", "Store", "StoreConfig"]
