"""`kvstore-bench vllm --tpot`: the rounds' order, prompts and the row made of them."""

from __future__ import annotations

from kvstore.bench import vllm_tpot
from kvstore.bench.vllm_engine import kv_transfer_config


def test_rounds_reverse_the_order_so_no_variant_always_runs_first():
    first, second = vllm_tpot.order(0), vllm_tpot.order(1)
    assert set(first) == set(vllm_tpot.VARIANTS) and first == second[::-1]
    assert first[0] != second[0] and vllm_tpot.order(2) == first


def test_prompts_are_shared_within_a_round_and_new_in_every_round():
    a, again, b = vllm_tpot.sessions(64, 0), vllm_tpot.sessions(64, 0), vllm_tpot.sessions(64, 1)
    assert a == again and a != b
    assert len(a) == vllm_tpot.NUM_PROMPTS and all(len(s["turns"][0]) == 64 for s in a)


def test_the_variants_are_no_connector_a_null_connector_and_kvstores():
    configs = {}
    for name, (connector, extra) in vllm_tpot.VARIANTS.items():
        spec = {"connector": connector, "store": "127.0.0.1:1", "connector_extra": extra}
        configs[name] = kv_transfer_config(spec)
    assert configs["recompute"] is None
    assert configs["null"]["kv_connector_module_path"] == "kvstore.bench.null_connector"
    assert configs["kvstore"]["kv_connector_module_path"] == "kvstore.integrations.vllm.connector"
    assert "kvstore.save" not in configs["kvstore"]["kv_connector_extra_config"]  # publishing


def test_publish_totals_come_from_the_connectors_shutdown_line():
    log = "INFO x\nINFO event=publish_stats published=12 dropped=3 failed=1\n"
    assert vllm_tpot.published(log) == (12, 3, 1)
    assert vllm_tpot.published("a process killed before its shutdown\n") == (0, 0, 0)


def test_the_row_pairs_each_round_with_its_own_baseline():
    records = [{"tpot_s": t} for t in (0.010, 0.030, 0.012)]
    assert vllm_tpot.process_tpot_ms(records) == 12.0
    rounds = [  # the host slows down in round 2; the ratio does not
        {"recompute": 10.0, "null": 10.0, "kvstore": 10.2},
        {"recompute": 20.0, "null": 20.0, "kvstore": 20.8},
        {"recompute": 10.0, "null": 10.0, "kvstore": 11.0},
    ]
    row = vllm_tpot.tpot_row(2048, rounds, (96, 0, 0), True)
    assert (row["ratio_p50"], row["ratio_min"], row["ratio_max"]) == (1.04, 1.02, 1.1)
    assert (row["ratio_null_p50"], row["ratio_vs_none_p50"]) == (1.0, 1.04)
    assert (row["tpot_recompute_ms"], row["tpot_kvstore_ms"]) == (10.0, 11.0)
    assert row["within_target"] is True and row["published_blocks"] == 96
    slow = [{"recompute": 10.0, "null": 10.0, "kvstore": 10.6}] * 3
    assert vllm_tpot.tpot_row(2048, slow, (96, 0, 0), True)["within_target"] is False


def test_the_target_divides_by_the_null_connector_not_by_none():
    # vLLM decodes faster once any connector is set: kvstore's own cost is over the null one.
    rounds = [{"recompute": 40.0, "null": 30.0, "kvstore": 33.0}] * 3
    row = vllm_tpot.tpot_row(2048, rounds, (96, 0, 0), True)
    assert (row["ratio_p50"], row["ratio_vs_none_p50"]) == (1.1, 0.825)
    assert row["within_target"] is False
