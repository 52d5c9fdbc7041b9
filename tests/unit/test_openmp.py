"""The OpenMP wait chosen from the machine's load (grpo_lightning/openmp.py): the rule by hand, the load against a
process the test keeps busy, and the choice in a fresh process, where torch has not loaded yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lightning.openmp import others_busy_cores, threads_would_wait

ROOT = Path(__file__).resolve().parents[2]
CHOOSE = "import os, grpo_lightning.openmp as o; o.set_openmp_wait(); print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(
    ("others", "available", "threads", "waits"),
    [
        (0.0, 2, 2, False),  # a quiet machine: spin
        (0.4, 2, 2, False),  # a little noise: still spin
        (1.0, 2, 2, True),  # one busy process beside two threads: sleep
        (1.0, 2, 1, False),  # one thread has its core
        (2.0, 4, 2, False),
        (3.0, 4, 2, True),
    ],
)
def test_the_rule_by_hand(others, available, threads, waits):
    assert threads_would_wait(others, available, threads) is waits


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_a_busy_process_beside_is_seen_and_chosen_for():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert others_busy_cores(0.3) >= 0.8  # at least the test's own busy process (others may add)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        chosen = subprocess.run([sys.executable, "-c", CHOOSE], capture_output=True, text=True, env=env, cwd=ROOT,
                                timeout=60, check=True).stdout.strip()  # fmt: skip
    finally:
        busy.kill()
        busy.wait()
    expected = "PASSIVE" if len(os.sched_getaffinity(0)) <= 2 else chosen  # more cores: one busy leaves enough
    assert chosen == expected


def test_a_policy_the_user_set_is_kept():
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "5")):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | {name: value}
        chosen = subprocess.run([sys.executable, "-c", CHOOSE], capture_output=True, text=True, env=env, cwd=ROOT,
                                timeout=60, check=True).stdout.strip()  # fmt: skip
        assert chosen == ("ACTIVE" if name == "OMP_WAIT_POLICY" else "None"), (name, chosen)
