"""`kvstore-bench vllm` says what to install when a compared system's venv is missing."""

from __future__ import annotations

import dataclasses

import pytest

import bench.vllm
from bench.suites import SuiteOptions
from bench.vllm_systems import SYSTEMS, System


def test_a_missing_venv_names_the_make_target_that_builds_it():
    absent = System("lmcache", "lmcache", ".venv-never-built", is_shared=True)
    hint = absent.missing()
    assert (
        hint
        == "lmcache needs .venv-never-built: run `make .venv-never-built/bin/.installed` (minutes)"
    )


def test_without_the_vllm_venv_the_suite_exits_with_the_command_to_run(monkeypatch):
    unbuilt = tuple(dataclasses.replace(s, venv=".venv-never-built") for s in SYSTEMS)
    monkeypatch.setattr(bench.vllm, "SYSTEMS", unbuilt)
    with pytest.raises(SystemExit, match=r"run `make \.venv-never-built/bin/\.installed`"):
        bench.vllm.run(SuiteOptions(quick=True))
