"""Runs of a benchmark: named configurations, each trained by the CLI in its own folder, resumable.

The learning benchmarks (benchmarks/learning.py, benchmarks/variants.py; docs/learning.md) train several
configurations for several seeds. Each run is a `python -m grpo_lightning` subprocess writing into
`<out>/<name>`; a run that finished before (a `final_metrics.json` in its folder) is read, not rerun, so an
interrupted benchmark continues where it stopped, and an unfinished folder is started over. Each run's wall time
goes to `<folder>/wall_s.txt`. `compose` gives the config a run will get, for checking and printing a
benchmark's settings before hours of training.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass(frozen=True)
class Job:
    name: str
    """The run's folder below the benchmark's output folder, e.g. `trained_seed0`."""
    overrides: tuple[str, ...]
    """Every Hydra override of the run (experiment, seed, pinned settings)."""


def compose(overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """The config `python -m grpo_lightning <overrides>` runs with (Hydra's compose API; `paths.output_dir`,
    which only a Hydra run resolves, stays unresolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(f"the config does not compose with {' '.join(overrides)}: {first}") from None


def value(cfg: DictConfig, key: str):
    """The resolved value at a dotted key (None when absent)."""
    return OmegaConf.select(cfg, key, default=None)


def finished(run_dir: Path) -> bool:
    return (run_dir / "final_metrics.json").is_file()


def wall_seconds(run_dir: Path) -> float:
    """The run's wall time as the benchmark measured it (NaN for a run it did not start)."""
    path = run_dir / "wall_s.txt"
    return float(path.read_text()) if path.is_file() else float("nan")


def cli_command(job: Job, run_dir: Path) -> list[str]:
    """The command that trains `job` into `run_dir`: the CLI in a subprocess, without the progress bar."""
    return [
        sys.executable,
        "-m",
        "grpo_lightning",
        *job.overrides,
        f"hydra.run.dir={run_dir}",
        "trainer.enable_progress_bar=false",
    ]


def run_jobs(
    out: Path,
    jobs: list[Job],
    parallel: bool,
    force: bool = False,
    slots: int | None = None,
    command: Callable[[Job, Path], list[str]] = cli_command,
) -> dict[str, Path]:
    """Run every job not finished before and return each job's folder by name. Exits naming the log of a run
    that failed, after stopping the runs still going (an unfinished folder is started over next time).

    `parallel`: up to `slots` runs at once (default: the CPU count), one thread each, the rest queued in order;
    else one after the other, each with every thread. Parallel suits a small CPU: a 135M model's matrices are
    too small to keep several threads busy, so runs side by side with one thread each finish sooner than one
    after the other, and they see the same load. Hand a benchmark's runs over all seeds in one call, so no core
    waits for a seed's last run.
    """
    slots = max(1, slots or os.cpu_count() or 1) if parallel else 1
    queue = []
    for job in jobs:
        run_dir = out / job.name
        if finished(run_dir) and not force:
            print(f"{job.name}: finished before, reading it", flush=True)
            continue
        queue.append((job, run_dir))
    running: list[_Run] = []
    try:
        while queue or running:
            while queue and len(running) < slots:
                running.append(_start(out, *queue.pop(0), command, one_thread=parallel))
            time.sleep(0.5)
            for run in [r for r in running if r.proc.poll() is not None]:
                running.remove(run)
                run.finish()
    except BaseException:
        for run in running:
            run.stop()
        raise
    return {job.name: out / job.name for job in jobs}


@dataclass
class _Run:
    """A run started by `run_jobs`: its folder, its log, when it started and its process."""

    run_dir: Path
    log: IO[str]
    start: float
    proc: subprocess.Popen

    def finish(self) -> None:
        """Record the wall time of a run that ended; exit naming its log if it failed."""
        self.log.close()
        if self.proc.returncode != 0:
            raise SystemExit(f"{self.run_dir.name} failed (exit {self.proc.returncode}); see {self.log.name}")
        elapsed = time.perf_counter() - self.start
        (self.run_dir / "wall_s.txt").write_text(f"{elapsed:.1f}\n")
        print(f"{self.run_dir.name}: done in {elapsed:.0f} s", flush=True)

    def stop(self) -> None:
        """End a run still going (another failed, or the benchmark was interrupted); its folder stays unfinished."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        print(f"{self.run_dir.name}: stopped, unfinished", flush=True)


def _start(out: Path, job: Job, run_dir: Path, command: Callable[[Job, Path], list[str]], one_thread: bool) -> _Run:
    if run_dir.exists():  # unfinished or forced: start over
        shutil.rmtree(run_dir)
    cmd = command(job, run_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1") if one_thread else os.environ.copy()
    print(f"{job.name}: {' '.join(cmd[1:])}", flush=True)
    log = open(out / f"{job.name}.log", "w")  # noqa: SIM115 - closed when the run ends
    return _Run(run_dir, log, time.perf_counter(), subprocess.Popen(cmd, stdout=log, stderr=log, env=env))
