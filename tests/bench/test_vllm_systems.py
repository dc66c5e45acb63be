"""`kvstore-bench vllm` says what to install when a compared system's venv is missing."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import kvstore.bench.vllm
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.vllm_engine import kv_transfer_config
from kvstore.bench.vllm_systems import ROOT, SYSTEMS, System


def test_venvs_are_looked_for_at_the_repository_root():
    """Where the Makefile builds them; a venv path under the package would read as missing."""
    assert (ROOT / "Makefile").is_file() and (ROOT / "pyproject.toml").is_file()
    assert all(s.python.startswith(str(ROOT / s.venv)) for s in SYSTEMS)


def test_a_missing_venv_names_the_make_target_that_builds_it():
    absent = System("lmcache", "lmcache", ".venv-never-built", is_shared=True)
    hint = absent.missing()
    assert (
        hint
        == "lmcache needs .venv-never-built: run `make .venv-never-built/bin/.installed` (minutes)"
    )


def test_without_the_vllm_venv_the_suite_exits_with_the_command_to_run(monkeypatch):
    unbuilt = tuple(dataclasses.replace(s, venv=".venv-never-built") for s in SYSTEMS)
    monkeypatch.setattr(kvstore.bench.vllm, "SYSTEMS", unbuilt)
    with pytest.raises(SystemExit, match=r"run `make \.venv-never-built/bin/\.installed`"):
        kvstore.bench.vllm.run(SuiteOptions(quick=True))


def test_the_staged_kvstore_runs_only_when_asked_and_loads_before_the_forward_pass():
    parser = argparse.ArgumentParser()
    kvstore.bench.vllm.add_arguments(parser)
    default = parser.parse_args([]).systems.split(",")
    assert "kvstore" in default and "kvstore-staged" not in default
    staged = next(s for s in SYSTEMS if s.name == "kvstore-staged")
    spec = {"connector": staged.connector, "store": "127.0.0.1:1"}
    config = kv_transfer_config(spec | {"connector_extra": dict(staged.connector_extra)})
    assert config is not None
    assert config["kv_connector_extra_config"]["kvstore.load_by_layer"] is False


def test_every_lmcache_server_takes_engine_driven_transfers_and_the_default_its_chunks():
    """vLLM on CPU registers its caches for engine-driven transfers only; LMCache's own
    default chunk size (256) is the compared one, the others run only when asked."""
    lmcache = {s.name: s for s in SYSTEMS if s.connector == "lmcache"}
    for system in lmcache.values():
        mode = system.server_flags[system.server_flags.index("--supported-transfer-mode") + 1]
        assert mode in ("engine_driven", "auto")
    default = lmcache["lmcache"].server_flags
    assert default[default.index("--chunk-size") + 1] == "256" and lmcache["lmcache"].by_default
    assert not any(s.by_default for name, s in lmcache.items() if name != "lmcache")


def test_lmcache_takes_its_shared_memory_pool_on_one_host_only_and_zero_copy_is_vllms_ask():
    lmcache = {s.name: s for s in SYSTEMS if s.connector == "lmcache"}
    cmd = lmcache["lmcache"].lmcache_command(4321)
    assert cmd[cmd.index("--shm-name") + 1] == "kvbench-lmcache-4321"
    assert "--no-l1-use-lazy" in cmd  # without it the server keeps pickling
    across = lmcache["lmcache"].lmcache_command(4321, "10.0.0.1", one_host=False)
    assert "--shm-name" not in across and across[across.index("--host") + 1] == "10.0.0.1"
    assert "--shm-name" not in lmcache["lmcache-pickle"].lmcache_command(4321)
    zero_copy = lmcache["lmcache-zero-copy"]
    spec = {"connector": "lmcache", "lmcache_port": 4321}
    config = kv_transfer_config(spec | {"connector_extra": dict(zero_copy.connector_extra)})
    assert config is not None
    extra = config["kv_connector_extra_config"]
    assert extra["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"
    assert extra["lmcache.mp.port"] == 4321


def test_across_namespaces_what_moves_kv_through_dev_shm_does_not_run():
    """/dev/shm is one for every network namespace: across them it would cross nothing."""
    one_host = [s for s in SYSTEMS if s.one_host_only]
    assert [s.name for s in one_host] == ["lmcache-zero-copy"]
    assert not kvstore.bench.vllm._usable(one_host[0], across=True)
