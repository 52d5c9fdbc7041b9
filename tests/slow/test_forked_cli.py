"""A forked CLI run (tests/forked_cli.py) is what the real process is: the truth is `python -m grpo_lightning` itself,
run the same way, compared output for output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked_cli import ForkedRun, cli_popen, cli_run

ROOT = Path(__file__).resolve().parents[2]


def real(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return dict(env, PYTHONPATH=str(ROOT), **values)


@pytest.mark.parametrize(
    "args",
    [
        ("--cfg", "job", "loss=dr_grpo"),  # Hydra's own flags: the composed config on stdout
        ("dry_run=true", "variant.num_generations=1"),  # a config mistake: exit 2, one line, no traceback
        ("dry_run=true", "loss=foo"),  # Hydra's own composition error: exit 1
    ],
    ids=["cfg job", "config mistake", "composition error"],
)
def test_a_forked_run_prints_and_exits_as_the_real_process(tmp_path, args):
    env = _env()
    forked = cli_run(*args, f"hydra.run.dir={tmp_path}/forked", cwd=tmp_path, env=env)
    truth = real(*args, f"hydra.run.dir={tmp_path}/real", cwd=tmp_path, env=env)
    assert forked.returncode == truth.returncode
    assert forked.stdout.replace("forked", "real") == truth.stdout
    assert forked.stderr.replace("forked", "real") == truth.stderr


def test_a_forked_run_reads_its_own_environment_and_working_directory(tmp_path):
    """HYDRA_FULL_ERROR given to this run only, and a relative run directory under this run's cwd."""
    args = ("dry_run=true", "variant.num_generations=1", "hydra.run.dir=rel")
    forked = cli_run(*args, cwd=tmp_path, env=_env(HYDRA_FULL_ERROR="1"))
    assert forked.returncode == 1 and "Traceback" in forked.stderr  # the full error, as the real CLI prints it
    assert cli_run(*args, cwd=tmp_path, env=_env()).stderr.startswith("error: variant.num_generations")
    assert not (ROOT / "rel").exists()


def test_signals_reach_the_forked_run_and_its_status_reads_as_popens(tmp_path):
    proc = cli_popen("model=tiny", f"hydra.run.dir={tmp_path}", "trainer.max_epochs=50", cwd=ROOT, env=_env())
    assert isinstance(proc, ForkedRun) and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_an_import_time_setting_gets_a_real_process(tmp_path):
    """OMP_NUM_THREADS is read when torch loads OpenMP, before any run: a fork would keep the server's."""
    threads = "2" if os.environ.get("OMP_NUM_THREADS") != "2" else "3"
    proc = cli_popen("--cfg", "job", cwd=tmp_path, env=_env(OMP_NUM_THREADS=threads))
    assert isinstance(proc, subprocess.Popen)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "loss_type" in out
