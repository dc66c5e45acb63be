"""`kvstore.bench.dataplane_memory`: a same-host get's two passes, alone and beside a neighbour."""

from kvstore.bench import dataplane_memory as memory


def test_the_ratios_say_what_each_neighbour_costs_and_where_a_get_can_fall() -> None:
    row = memory._with_ratios(
        {
            "block_kib": 1024,
            "memcpy_ms": 3.6,
            "copy_ms": 2.4,
            "check_ms": 1.6,
            "copy_core_busy_ms": 2.4,
            "copy_memory_busy_ms": 4.5,
            "neighbour_gbps": 21.456,
        }
    )
    assert row["neighbour_gbps"] == 21.46
    assert row["core_busy/alone"] == 1.0
    assert row["memory_busy/alone"] == 1.88
    assert row["alone get/memcpy"] == 1.5  # the check for free: memcpy over the copy
    assert row["serial get/memcpy"] == 0.9  # no overlap: memcpy over copy and check


def test_a_row_times_every_pass_with_its_neighbours_started_and_stopped() -> None:
    row = memory.measure(64 << 10, reps=2)
    passes = ("memcpy", "copy", "check", "copy_core_busy", "copy_memory_busy")
    assert row["block_kib"] == 64
    assert all(float(row[f"{p}_ms"]) > 0 for p in passes)
    assert float(row["alone get/memcpy"]) > float(row["serial get/memcpy"]) > 0
    assert "neighbour_gbps" in row  # how fast it summed meanwhile
