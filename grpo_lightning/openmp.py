"""How torch's OpenMP threads wait at a barrier, chosen from the machine's load before torch loads.

A CPU round is thousands of short parallel regions (every op of every decode step). Between them GNU OpenMP's
threads spin, waiting for the next (300,000 spins by default). On a quiet machine that is the fastest hand-over.
Beside another busy process it is the slowest: a thread spins on a core while the thread it waits for has none.
Measured on a 2-core AMD EPYC Zen 4, the default run's first four rounds (docs/performance.md, "Other work on the
machine"):

- alone: 101 s spinning, 115 s with threads that sleep at once (`OMP_WAIT_POLICY=PASSIVE`), 97 s with a shorter
  spin (`GOMP_SPINCOUNT=10000`; 100 spins: as slow as sleeping);
- beside one `while True: pass`: 292 s spinning, 165 s sleeping, 316 s with the 10,000-spin count, 169 s with 100.

No one setting is best for both, so `set_openmp_wait` looks: when other processes keep busy more cores than this
process's threads would leave them, threads sleep at once (`OMP_WAIT_POLICY=PASSIVE`); otherwise the default
spin stays. The wait policy changes no result, only who waits how. GNU OpenMP reads it once, when torch loads:
`python -m grpo_lightning` calls this first (grpo_lightning/__main__.py), and so do `benchmarks/vs_trl.py`'s
children, one per system; the other benchmarks that train run the CLI. A wait policy or spin count the user set
is kept.
"""

from __future__ import annotations

import os
import sys
import time

SAMPLE_SECONDS = 0.1
"""How long the machine's load is sampled (/proc/stat) before choosing."""
CHOICE: str | None = None
"""What `set_openmp_wait` chose and why (the run's log repeats it), None before it ran or where it did not look."""


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot (Linux /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _own_ticks() -> int:
    """This process's user + system clock ticks (/proc/self/stat)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def others_busy_cores(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores that other processes kept busy over `seconds` (this process's own time left out), None where the
    kernel's counters cannot be read."""
    before = _cpu_ticks()
    if before is None:
        return None
    own_before = _own_ticks()
    time.sleep(seconds)
    after, own_after = _cpu_ticks(), _own_ticks()
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    cores = os.cpu_count() or 1
    return max(0.0, (busy - (own_after - own_before)) / total * cores)


def set_openmp_wait() -> None:
    """`OMP_WAIT_POLICY=PASSIVE` when other processes leave fewer free cores than torch will run threads (the
    module docstring); nothing when the user set `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`, or torch is loaded."""
    global CHOICE
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    others = others_busy_cores()
    if others is None:
        return
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(threads) if threads.isdigit() and int(threads) > 0 else available
    passive = threads_would_wait(others, available, threads)
    if passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    waits = "sleep at barriers (OMP_WAIT_POLICY=PASSIVE; docs/performance.md)" if passive else "spin at barriers"
    CHOICE = f"other processes keep {others:.1f} of {available} cores busy: OpenMP threads {waits}"


def threads_would_wait(others_busy: float, available: int, threads: int) -> bool:
    """Whether `threads` OpenMP threads would find fewer free cores than themselves, half a core of slack: then a
    spinning thread takes the core the thread it waits for needs."""
    return available - others_busy < threads - 0.5
