"""`kvstore demo`: an embedded store, a prefix-reuse workload, every loaded block checked."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_reuses_the_shared_prefix_and_returns_intact_blocks():
    cmd = [sys.executable, "-m", "kvstore.cli", "demo", "--users", "2", "--dram-bytes", "64MiB"]
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no server log, no shutdown noise
    assert max(len(line) for line in out.stdout.splitlines()) <= 80  # an 80-column terminal
    text = " ".join(out.stdout.split())
    # 2 users x 2 rounds of 37 and 44 blocks; hits: round 0 shares the 32-block system
    # prompt, round 1 the user's whole round-0 prompt (37 blocks).
    assert "hit blocks 106/162" in text
    assert "all loaded blocks intact: True" in text
    assert "GB/s over shm)" in text  # the plane that moved the bytes: the node is on this host
