"""The plan's CPU-RAM estimate bounds what a run really takes: each preset run for one round through the CLI in a
process of its own, its peak resident size (the kernel's count for that child, `os.wait4`'s ru_maxrss) against the
`memory_cpu_ram` the same run printed before loading anything (app/memory.py).

The run is started by a small launcher process, not by the test's process. Linux keeps, in a process's ru_maxrss,
the high-water mark of the address space it replaced at `exec`, and a child that `subprocess` starts (vfork,
posix_spawn or fork) begins in its parent's address space or a copy of it: a run started from a pytest worker that
had peaked at 1.6 GiB in an earlier test reported 1.6 GiB, whatever it used itself (`python -c pass` started from
a process that once held 1 GiB reports ~1 GiB). The launcher, a fresh interpreter that imports nothing, peaks at
~10 MiB, so what the run it starts reports is the run's own.

The presets span float32 (tiny, the embedded SmolLM2-135M) and bfloat16 (the random-weight Qwen2.5 shapes), LoRA
merged for sampling (the CPU default, `perf.generate.merge_lora`), and the default settings beside the small ones
that keep the larger shapes' rounds short (`SMALL`).
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
SMALL = [
    "data.prompts_per_round=1",
    "variant.num_generations=2",
    "data.max_prompt_tokens=64",
    "generator.max_new_tokens=4",
    "eval.enabled=false",
]
"""The least work a round of the larger shapes can do: half-precision matmuls are emulated on CPUs without native
bf16 (one round of 1.5B at 2 prompts x 8 completions x 16 tokens took 50 minutes on a 2-core AVX2 EPYC), while the
peak that matters here, the weights, their merged copy and the head, is the same at any length."""
RUNS = {
    "tiny, defaults": ["model=tiny"],
    "embedded 135M, defaults (evaluations at the start and the end)": [],
    "Qwen2.5-0.5B shape, small": ["model=random_qwen0.5b", *SMALL],
    "Qwen2.5-1.5B shape, small": ["model=random_qwen1.5b", *SMALL],
}


LAUNCHER = """
import os, sys
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[1:]], os.environ)
_, status, usage = os.wait4(pid, 0)
print(f"launcher: exit {os.waitstatus_to_exitcode(status)}, ru_maxrss {usage.ru_maxrss} KiB", flush=True)
"""
"""Runs `python <args>` and reports its exit code and peak (module docstring); nothing imported beyond os and sys."""
LAUNCHER_REPORT = re.compile(r"^launcher: exit (-?\d+), ru_maxrss (\d+) KiB$", re.MULTILINE)


def launched(args: list[str]) -> tuple[int, float, str]:
    """(exit code, peak RSS in GiB, output) of `python *args` started by the launcher."""
    command = [sys.executable, "-c", LAUNCHER, *args]
    output = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    report = LAUNCHER_REPORT.findall(output)
    assert len(report) == 1, output[-3000:]
    return int(report[0][0]), int(report[0][1]) * 1024 / GIB, output  # ru_maxrss: KiB on Linux


def peak_and_plan(overrides: list[str], run_dir: Path) -> tuple[float, float]:
    """(peak RSS, planned CPU RAM) of a one-round run, in GiB."""
    code, peak, output = launched(["-m", "grpo_lightning", *overrides, "trainer.max_epochs=1",
                                   "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert code == 0, output[-3000:]
    planned = re.search(r"memory_cpu_ram\s+~([\d.]+) GiB", output)
    assert planned is not None, output[-3000:]
    return peak, float(planned.group(1))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_the_measurement_leaves_out_what_the_test_process_held_before():
    """After this process has held 1 GiB, a child it starts itself reports at least that; one the launcher starts
    reports its own ~10 MiB."""
    ballast = b"\x01" * GIB  # resident: every page written
    del ballast
    direct = subprocess.Popen([sys.executable, "-c", "pass"])
    _, status, usage = os.wait4(direct.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and usage.ru_maxrss * 1024 >= GIB
    code, peak, output = launched(["-c", "pass"])
    assert code == 0 and peak < 0.1, output


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
@pytest.mark.parametrize("name", list(RUNS))
def test_the_measured_peak_stays_under_the_plan(tmp_path, name):
    peak, planned = peak_and_plan(RUNS[name], tmp_path / "run")
    print(f"{name}: peak {peak:.2f} GiB, planned {planned:.2f} GiB")
    assert peak <= planned, f"{name}: peak {peak:.2f} GiB above the plan's {planned:.2f} GiB"
