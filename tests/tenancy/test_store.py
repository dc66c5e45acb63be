"""Tenants in process: the server-derived mapping, the public tenant, per-tenant quotas in
DRAM and on SSD, per-tenant bounds and stats, over a real `Store`."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.store.caller import Caller
from kvstore.tenancy import TenantQuotas, TenantRoles, Tenants

NS = Namespace("tenant-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
BLOCK = NS.block_bytes
SECRET = bytes(range(32))


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def _put(store: Store, caller: Caller, keys: list[bytes]) -> int:
    res = store.reserve(NS.id, keys, [None, *keys[:-1]], caller)
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            res.write(i, 0, _payload(keys[i]))
    return res.commit()


def _store(num_blocks: int = 64, quotas: str = "", tmp_path=None, **kw) -> Store:
    config = StoreConfig(dram_bytes=num_blocks * BLOCK, slab_bytes=4 * BLOCK, **kw)
    parsed = None
    if quotas:
        path = tmp_path / "quotas"
        path.write_text(quotas)
        parsed = TenantQuotas.load(path)
    return Store(config, quotas=parsed)


TENANTS = Tenants(SECRET, TenantRoles(public_tenant="pub"))


def _callers(tenants: Tenants, *names: str) -> list[Caller]:
    return [tenants.caller(name, "ipv4:10.0.0.1:1") for name in names]


def test_two_tenants_with_the_same_model_never_share_a_block():
    store = _store()
    a, b = _callers(TENANTS, "a", "b")
    assert store.register_namespace(NS, a).namespace_id == NS.id  # the client's, never internal
    assert store.register_namespace(NS, b).namespace_id == NS.id
    keys = _chain(4)
    assert _put(store, a, keys) == 4
    assert store.match(NS.id, keys, b).num_matched == 0
    assert store.acquire(NS.id, keys, caller=b).found == (False,) * 4
    res = store.reserve(NS.id, keys, [None, *keys[:-1]], b)
    assert res.statuses == (PutStatus.RESERVED,) * 4  # not PRESENT, not IN_FLIGHT
    res.abort()
    assert store.remove(NS.id, keys, b) == 0 and store.match(NS.id, keys, a).num_matched == 4
    assert store.stats().num_namespaces == 2  # two internal namespaces
    store.check_integrity()


def test_the_internal_id_is_keyed_by_the_secret_and_the_tenant():
    ids = {
        TENANTS.tenant_map.internal_id("a", NS.id),
        TENANTS.tenant_map.internal_id("b", NS.id),
        Tenants(bytes(32)).tenant_map.internal_id("a", NS.id),
    }
    assert len(ids) == 3 and NS.id not in ids
    assert Tenants(None).tenant_map.internal_id("", NS.id) == NS.id  # no tenants: identity


def test_a_namespace_only_another_tenant_registered_is_unknown():
    store = _store()
    a, b = _callers(TENANTS, "a", "b")
    store.register_namespace(NS, a)
    calls = (
        lambda: store.match(NS.id, _chain(1), b),
        lambda: store.reserve(NS.id, _chain(1), caller=b),
        lambda: store.namespace(NS.id, b),
    )
    for call in calls:
        with pytest.raises(errors.UnknownNamespaceError):  # NOT_FOUND: nothing tells it apart
            call()


def test_the_public_tenant_publishes_and_the_others_read_only():
    store = _store()
    pub, b = _callers(TENANTS, "pub", "b")
    store.register_namespace(NS, pub)
    system = _chain(2)
    assert _put(store, pub, system) == 2
    assert store.match(NS.id, system, b).num_matched == 2  # read without registering
    with store.acquire(NS.id, system, caller=b) as lease:
        assert [bytes(v) for v in lease.views] == [_payload(k) for k in system]
    calls = (lambda: store.reserve(NS.id, system, caller=b), lambda: store.remove(NS.id, system, b))
    for call in calls:
        with pytest.raises(errors.PermissionDeniedError):
            call()
    store.register_namespace(NS, b)  # now b writes its own, and reads its own, then public
    turn = block_keys(NS, list(range(3 * NS.block_tokens)))[2:]
    own = _chain(3)[:2] + turn
    assert own[:2] == system
    res = store.reserve(NS.id, [turn[0]], [system[1]], b)  # its parent is public: not b's
    assert res.statuses == (PutStatus.RESERVED,)
    res.abort()
    assert store.match(NS.id, system, b).num_matched == 2
    assert store.remove(NS.id, system, b) == 0
    assert store.match(NS.id, system, pub).num_matched == 2
    store.check_integrity()


def test_quotas_evict_the_tenants_own_blocks_only(tmp_path):
    store = _store(64, "a dram=4KiB\nb dram=4KiB\n", tmp_path)  # 16 blocks each of 64
    a, b = _callers(TENANTS, "a", "b")
    store.register_namespace(NS, a)
    store.register_namespace(NS, b)
    b_keys = _chain(8, seed=1)
    assert _put(store, b, b_keys) == 8
    for seed in range(2, 8):
        assert _put(store, a, _chain(8, seed)) == 8  # a's 48 blocks through a quota of 16
    assert store.match(NS.id, b_keys, b).num_matched == 8  # b lost nothing
    assert store.tenant_bytes()["dram"] == {"a": 16 * BLOCK, "b": 8 * BLOCK}
    assert _put(store, b, _chain(8, seed=9)) == 8  # b's quota is there, whatever a holds
    store.check_integrity()


def test_a_tenant_past_its_quota_with_nothing_to_evict_fails_alone(tmp_path):
    store = _store(16, "* dram=2KiB\n", tmp_path)
    a, b = _callers(TENANTS, "a", "b")
    store.register_namespace(NS, a)
    store.register_namespace(NS, b)
    keys = _chain(8)
    assert _put(store, a, keys) == 8
    lease = store.acquire(NS.id, keys, caller=a)  # a's 8 blocks leased: none of them can go
    with pytest.raises(errors.StoreFullError, match="quota"):
        store.reserve(NS.id, _chain(1, seed=5), caller=a)
    assert _put(store, b, _chain(8, seed=6)) == 8
    lease.release()
    assert _put(store, a, _chain(1, seed=5)) == 1
    store.check_integrity()


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
    store = _store(
        16,
        "a dram=1KiB ssd=2KiB\nb dram=1KiB ssd=2KiB\n",
        tmp_path,
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=16 * BLOCK,
        background_demotion=False,
    )
    a, b = _callers(TENANTS, "a", "b")
    store.register_namespace(NS, a)
    store.register_namespace(NS, b)
    b_keys = _chain(4, seed=1)
    assert _put(store, b, b_keys) == 4
    store.demote_now()
    for seed in range(2, 10):
        assert _put(store, a, _chain(4, seed)) == 4
        store.demote_now()
    held = store.tenant_bytes()
    assert held["ssd"]["a"] <= 8 * BLOCK and held["dram"]["a"] <= 4 * BLOCK
    assert store.match(NS.id, b_keys, b).num_matched == 4  # b's blocks stayed, SSD or DRAM
    store.check_integrity()


def test_tenant_namespaces_and_bytes_survive_a_restart(tmp_path):
    kw = {"ssd_path": str(tmp_path / "ssd"), "ssd_bytes": 64 * BLOCK}
    store = _store(16, "", None, background_demotion=False, **kw)
    a, b = _callers(TENANTS, "a", "b")  # the same secret after the restart: the same ids
    store.register_namespace(NS, a)
    keys = _chain(16)
    assert _put(store, a, keys) == 16  # DRAM full: the commit's inline pass writes some out
    on_ssd = store.tenant_bytes()["ssd"]["a"] // BLOCK
    assert on_ssd > 0
    store.close()
    with _store(16, "", None, **kw) as again:
        assert again.tenant_bytes()["ssd"] == {"a": on_ssd * BLOCK}
        with pytest.raises(errors.UnknownNamespaceError):
            again.match(NS.id, keys, b)
        with again.acquire(NS.id, keys, caller=a) as lease:
            assert sum(lease.found) == on_ssd
            got = [checksum(bytes(v)) for v in lease.views if v is not None]
            hits = [k for k, hit in zip(keys, lease.found, strict=True) if hit]
            assert got == [checksum(_payload(k)) for k in hits]


def test_a_tenant_sees_its_own_stats_and_the_operator_the_node():
    store = _store()
    tenants = Tenants(SECRET, TenantRoles(admin_tenant="ops"))
    a, b, ops = _callers(tenants, "a", "b", "ops")
    store.register_namespace(NS, a)
    store.register_namespace(NS, b)
    before = store.stats(b)
    keys = _chain(4)
    _put(store, a, keys)
    store.acquire(NS.id, keys, caller=a).release()
    assert store.stats(b) == before
    mine = store.stats(a)
    assert (mine.num_blocks, mine.num_namespaces, mine.hits, mine.blocks_committed) == (4, 1, 4, 4)
    assert mine.bytes_written == mine.bytes_read == 4 * BLOCK
    assert mine.tiers[0].used_bytes == 4 * BLOCK
    assert store.stats(ops).num_namespaces == 2
    assert store.stats(ops) == store.stats()  # the operator sees the node


def test_namespaces_reservations_and_leases_are_bounded_per_tenant():
    store = Store(StoreConfig(dram_bytes=64 * BLOCK, max_reservations_per_client=2))
    tenants = Tenants(SECRET, TenantRoles(max_namespaces_per_tenant=1))
    a, b = _callers(tenants, "a", "b")
    store.register_namespace(NS, a)
    other = Namespace("tenant-model-2", NS.layout)
    with pytest.raises(errors.TooManyNamespacesError, match="tenant a"):
        store.register_namespace(other, a)
    store.register_namespace(other, b)
    for seed in range(2):
        store.reserve(NS.id, _chain(1, seed), caller=a)
    a_elsewhere = tenants.caller("a", "ipv4:10.0.0.2:1")
    with pytest.raises(errors.TooManyReservationsError):  # another client, the same tenant
        store.reserve(NS.id, _chain(1, 5), caller=a_elsewhere)
    store.reserve(other.id, block_keys(other, list(range(4))), caller=b)
