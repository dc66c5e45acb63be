"""Tenants in process: the server-derived mapping, the public tenant, per-tenant quotas in
DRAM and on SSD, per-tenant bounds and stats, over a real `Store`."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.tenancy import TenantQuotas, TenantRoles, Tenants, TenantScope

NS = Namespace("tenant-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
BLOCK = NS.block_bytes
SECRET = bytes(range(32))


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def _put(scope: TenantScope, keys: list[bytes]) -> int:
    res = scope.reserve(NS.id, keys, [None, *keys[:-1]])
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            scope.write(res.reservation_id, i, 0, _payload(keys[i]))
    return scope.commit(res.reservation_id)


def _tenants(num_blocks: int = 64, quotas: str = "", tmp_path=None, **kw) -> Tenants:
    config = StoreConfig(dram_bytes=num_blocks * BLOCK, slab_bytes=4 * BLOCK, **kw)
    parsed = None
    if quotas:
        path = tmp_path / "quotas"
        path.write_text(quotas)
        parsed = TenantQuotas.load(path)
    return Tenants(Store(config, quotas=parsed), SECRET, TenantRoles(public_tenant="pub"))


def test_two_tenants_with_the_same_model_never_share_a_block():
    tenants = _tenants()
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    assert a.register_namespace(NS).namespace_id == NS.id  # the client's id, never internal
    assert b.register_namespace(NS).namespace_id == NS.id
    keys = _chain(4)
    assert _put(a, keys) == 4
    assert b.match(NS.id, keys).num_matched == 0
    assert b.acquire(NS.id, keys).found == (False,) * 4
    res = b.reserve(NS.id, keys, [None, *keys[:-1]])
    assert res.statuses == (PutStatus.RESERVED,) * 4  # not PRESENT, not IN_FLIGHT
    b.abort(res.reservation_id)
    assert b.remove(NS.id, keys) == 0 and a.match(NS.id, keys).num_matched == 4
    assert tenants.store.stats().num_namespaces == 2  # two internal namespaces
    tenants.store.check_integrity()


def test_the_internal_id_is_keyed_by_the_secret_and_the_tenant():
    other = Tenants(Store(StoreConfig(dram_bytes=1 << 20)), bytes(32))
    ids = {
        _tenants().tenant_map.internal_id("a", NS.id),
        _tenants().tenant_map.internal_id("b", NS.id),
        other.tenant_map.internal_id("a", NS.id),
    }
    assert len(ids) == 3 and NS.id not in ids
    anonymous = Tenants(Store(StoreConfig(dram_bytes=1 << 20)), None)
    assert anonymous.tenant_map.internal_id("", NS.id) == NS.id  # no tenants: identity


def test_a_namespace_only_another_tenant_registered_is_unknown():
    tenants = _tenants()
    TenantScope(tenants, "a").register_namespace(NS)
    b = TenantScope(tenants, "b")
    for call in (lambda: b.match(NS.id, _chain(1)), lambda: b.reserve(NS.id, _chain(1))):
        with pytest.raises(errors.UnknownNamespaceError):  # NOT_FOUND: nothing tells it apart
            call()


def test_the_public_tenant_publishes_and_the_others_read_only():
    tenants = _tenants()
    pub, b = TenantScope(tenants, "pub"), TenantScope(tenants, "b")
    pub.register_namespace(NS)
    system = _chain(2)
    assert _put(pub, system) == 2
    assert b.match(NS.id, system).num_matched == 2  # read without registering
    lease = b.acquire(NS.id, system)
    assert [bytes(v) for v in lease.views] == [_payload(k) for k in system]
    b.release(lease.lease_id)
    for call in (lambda: b.reserve(NS.id, system), lambda: b.remove(NS.id, system)):
        with pytest.raises(errors.PermissionDeniedError):
            call()
    b.register_namespace(NS)  # now b writes its own, and reads its own first, then public
    turn = block_keys(NS, list(range(3 * NS.block_tokens)))[2:]
    own = _chain(3)[:2] + turn
    assert own[:2] == system
    res = b.reserve(NS.id, [turn[0]], [system[1]])  # its parent is public: not b's
    assert res.statuses == (PutStatus.RESERVED,)
    b.abort(res.reservation_id)
    assert b.match(NS.id, system).num_matched == 2
    assert b.remove(NS.id, system) == 0 and pub.match(NS.id, system).num_matched == 2
    tenants.store.check_integrity()


def test_quotas_evict_the_tenants_own_blocks_only(tmp_path):
    tenants = _tenants(64, "a dram=4KiB\nb dram=4KiB\n", tmp_path)  # 16 blocks each of 64
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    a.register_namespace(NS)
    b.register_namespace(NS)
    b_keys = _chain(8, seed=1)
    assert _put(b, b_keys) == 8
    for seed in range(2, 8):
        assert _put(a, _chain(8, seed)) == 8  # a's 48 blocks through a quota of 16
    assert b.match(NS.id, b_keys).num_matched == 8  # b lost nothing
    assert tenants.store.tenant_bytes()["dram"] == {"a": 16 * BLOCK, "b": 8 * BLOCK}
    assert _put(b, _chain(8, seed=9)) == 8  # b's quota is there, whatever a holds
    tenants.store.check_integrity()


def test_a_tenant_past_its_quota_with_nothing_to_evict_fails_alone(tmp_path):
    tenants = _tenants(16, "* dram=2KiB\n", tmp_path)
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    a.register_namespace(NS)
    b.register_namespace(NS)
    keys = _chain(8)
    assert _put(a, keys) == 8
    lease = a.acquire(NS.id, keys)  # a's 8 blocks leased: none of them can go
    with pytest.raises(errors.StoreFullError, match="quota"):
        a.reserve(NS.id, _chain(1, seed=5))
    assert _put(b, _chain(8, seed=6)) == 8
    a.release(lease.lease_id)
    assert _put(a, _chain(1, seed=5)) == 1
    tenants.store.check_integrity()


def test_quotas_that_sum_above_a_tier_are_refused(tmp_path):
    path = tmp_path / "quotas"
    path.write_text("a dram=3MiB ssd=1GiB\n* dram=2MiB\n")
    quotas = TenantQuotas.load(path)
    assert (quotas.quota("a", "dram"), quotas.quota("z", "dram")) == (3 << 20, 2 << 20)
    assert quotas.quota("z", "ssd") is None
    quotas.check_capacity({"a", "b"}, "dram", 5 << 20)
    with pytest.raises(errors.InvalidArgumentError, match="sum"):
        quotas.check_capacity({"a", "b", "c"}, "dram", 5 << 20)
    with pytest.raises(errors.InvalidArgumentError, match="no ssd quota"):
        quotas.check_capacity({"a", "b"}, "ssd", 4 << 30)
    for bad in ("a dram=lots\n", "a\n", "a hbm=1MiB\n", "a dram=1MiB\na ssd=1MiB\n"):
        path.write_text(bad)
        with pytest.raises(errors.InvalidArgumentError):
            TenantQuotas.load(path)


def test_ssd_quotas_demote_and_drop_within_the_tenant(tmp_path):
    tenants = _tenants(
        16,
        "a dram=1KiB ssd=2KiB\nb dram=1KiB ssd=2KiB\n",
        tmp_path,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=16 * BLOCK,
        background_demotion=False,
    )
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    a.register_namespace(NS)
    b.register_namespace(NS)
    b_keys = _chain(4, seed=1)
    assert _put(b, b_keys) == 4
    tenants.store.demote_now()
    for seed in range(2, 10):
        assert _put(a, _chain(4, seed)) == 4
        tenants.store.demote_now()
    held = tenants.store.tenant_bytes()
    assert held["ssd"]["a"] <= 8 * BLOCK and held["dram"]["a"] <= 4 * BLOCK
    assert b.match(NS.id, b_keys).num_matched == 4  # b's blocks stayed, on SSD or DRAM
    tenants.store.check_integrity()


def test_tenant_namespaces_and_bytes_survive_a_restart(tmp_path):
    kw = {"ssd_path": str(tmp_path / "ssd"), "ssd_bytes": 64 * BLOCK}
    tenants = _tenants(16, "", None, background_demotion=False, **kw)
    a = TenantScope(tenants, "a")
    a.register_namespace(NS)
    keys = _chain(16)
    assert _put(a, keys) == 16  # DRAM full: the commit's inline pass writes some out
    on_ssd = tenants.store.tenant_bytes()["ssd"]["a"] // BLOCK
    assert on_ssd > 0
    tenants.store.close()
    again = _tenants(16, "", None, **kw)  # the same secret: the same internal ids
    try:
        assert again.store.tenant_bytes()["ssd"] == {"a": on_ssd * BLOCK}
        with pytest.raises(errors.UnknownNamespaceError):
            TenantScope(again, "b").match(NS.id, keys)
        lease = TenantScope(again, "a").acquire(NS.id, keys)
        assert sum(lease.found) == on_ssd
        got = [checksum(bytes(v)) for v in lease.views if v is not None]
        assert got == [
            checksum(_payload(k)) for k, hit in zip(keys, lease.found, strict=True) if hit
        ]
        TenantScope(again, "a").release(lease.lease_id)
    finally:
        again.store.close()


def test_a_tenant_sees_its_own_stats_and_the_operator_the_node():
    store = Store(StoreConfig(dram_bytes=64 * BLOCK, slab_bytes=4 * BLOCK))
    tenants = Tenants(store, SECRET, TenantRoles(admin_tenant="ops"))
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    a.register_namespace(NS)
    b.register_namespace(NS)
    before = b.stats()
    keys = _chain(4)
    _put(a, keys)
    a.release(a.acquire(NS.id, keys).lease_id)
    assert b.stats() == before
    mine = a.stats()
    assert (mine.num_blocks, mine.num_namespaces, mine.hits, mine.blocks_committed) == (4, 1, 4, 4)
    assert mine.bytes_written == mine.bytes_read == 4 * BLOCK
    assert mine.tiers[0].used_bytes == 4 * BLOCK
    assert TenantScope(tenants, "ops").stats().num_namespaces == 2


def test_namespaces_reservations_and_leases_are_bounded_per_tenant():
    config = StoreConfig(dram_bytes=64 * BLOCK, max_reservations_per_client=2)
    tenants = Tenants(Store(config), SECRET, TenantRoles(max_namespaces_per_tenant=1))
    a, b = TenantScope(tenants, "a"), TenantScope(tenants, "b")
    a.register_namespace(NS)
    other = Namespace("tenant-model-2", NS.layout)
    with pytest.raises(errors.TooManyNamespacesError, match="tenant a"):
        a.register_namespace(other)
    b.register_namespace(other)
    for seed in range(2):
        a.reserve(NS.id, _chain(1, seed), owner="ipv4:10.0.0.1:1")
    with pytest.raises(errors.TooManyReservationsError):  # another client, the same tenant
        a.reserve(NS.id, _chain(1, 5), owner="ipv4:10.0.0.2:1")
    b.reserve(other.id, block_keys(other, list(range(4))))
