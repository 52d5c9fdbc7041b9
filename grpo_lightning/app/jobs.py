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
from dataclasses import dataclass
from pathlib import Path

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


def run_jobs(out: Path, jobs: list[Job], parallel: bool, force: bool = False) -> dict[str, Path]:
    """Run every job not finished before (all at once with `parallel`, one thread each; else one after the
    other) and return each job's folder by name. Exits naming the log of a run that failed.

    `parallel` suits a small CPU: a 135M model's matrices are too small to keep several threads busy, so runs
    side by side with one thread each finish sooner than one after the other, and they see the same load.
    """
    started = []
    for job in jobs:
        run_dir = out / job.name
        if finished(run_dir) and not force:
            print(f"{job.name}: finished before, reading it", flush=True)
            continue
        if run_dir.exists():  # unfinished or forced: start over
            shutil.rmtree(run_dir)
        cmd = [sys.executable, "-m", "grpo_lightning", *job.overrides]
        cmd += [f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false"]
        env = dict(os.environ, OMP_NUM_THREADS="1") if parallel else os.environ.copy()
        print(f"{job.name}: {' '.join(cmd[1:])}", flush=True)
        log = open(out / f"{job.name}.log", "w")  # noqa: SIM115 - closed when the run ends
        started.append((run_dir, log, time.perf_counter(), subprocess.Popen(cmd, stdout=log, stderr=log, env=env)))
        if not parallel:
            _wait_all(started[-1:])
    if parallel:
        _wait_all(started)
    return {job.name: out / job.name for job in jobs}


def _wait_all(started: list) -> None:
    """Wait for the runs, timing each to its own end; exit at the first that failed."""
    pending = list(started)
    while pending:
        for entry in list(pending):
            run_dir, log, start, proc = entry
            if proc.poll() is None:
                continue
            pending.remove(entry)
            log.close()
            if proc.returncode != 0:
                raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {log.name}")
            elapsed = time.perf_counter() - start
            (run_dir / "wall_s.txt").write_text(f"{elapsed:.1f}\n")
            print(f"{run_dir.name}: done in {elapsed:.0f} s", flush=True)
        if pending:
            time.sleep(0.5)
