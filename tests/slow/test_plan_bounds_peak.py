"""The plan's CPU-RAM estimate bounds what a run really takes: each preset run for one round through the CLI in a
process of its own, its peak resident size (the kernel's count for that child, `os.wait4`'s ru_maxrss) against the
`memory_cpu_ram` the same run printed before loading anything (app/memory.py).

The presets span float32 (tiny, the embedded SmolLM2-135M) and bfloat16 (the random-weight Qwen2.5 shapes), LoRA
merged for sampling (the CPU default, `perf.generate.merge_lora`), and the default settings beside the small ones
a measurement would use.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
SMALL = ["generator.max_new_tokens=16", "data.prompts_per_round=2", "eval.enabled=false"]
RUNS = {
    "tiny, defaults": ["model=tiny"],
    "embedded 135M, defaults (evaluations at the start and the end)": [],
    "Qwen2.5-0.5B shape, small": ["model=random_qwen0.5b", *SMALL],
    "Qwen2.5-1.5B shape, small": ["model=random_qwen1.5b", *SMALL],
}


def peak_and_plan(overrides: list[str], run_dir: Path) -> tuple[float, float]:
    """(peak RSS, planned CPU RAM) of a one-round run, in GiB."""
    args = [sys.executable, "-m", "grpo_lightning", *overrides, "trainer.max_epochs=1",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    child = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, output[-3000:]
    planned = re.search(r"memory_cpu_ram\s+~([\d.]+) GiB", output)
    assert planned is not None, output[-3000:]
    return usage.ru_maxrss * 1024 / GIB, float(planned.group(1))  # ru_maxrss: KiB on Linux


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
@pytest.mark.parametrize("name", list(RUNS))
def test_the_measured_peak_stays_under_the_plan(tmp_path, name):
    peak, planned = peak_and_plan(RUNS[name], tmp_path / "run")
    print(f"{name}: peak {peak:.2f} GiB, planned {planned:.2f} GiB")
    assert peak <= planned, f"{name}: peak {peak:.2f} GiB above the plan's {planned:.2f} GiB"
