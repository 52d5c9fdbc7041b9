"""How the run's processes start and wait for each other (grpo_lightning/app/launch.py).

Truths: the environment Lightning's own DDP launcher gives the processes it starts (its launcher run with `Popen`
recorded), the variables each launcher sets as Lightning's cluster environments read them, torch's own default
timeout, and, for the bound on a wait, two real processes of which one stops: the run must end within the bound,
with one line naming the setting, and leave no process behind.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from torch.distributed.constants import default_pg_timeout

from grpo_lightning.app.launch import bounded_strategy, check_launch, launcher, trainer_node
from grpo_lightning.app.parts import build_trainer
from grpo_lightning.app.validation import validate
from grpo_lightning.sharding import FullyShardedStrategy
from tests.conftest import make_cfg
from tests.forked_cli import cli_popen, cli_run
from tests.test_bad_input import TINY, assert_clean_failure, cli

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                    "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                    "PMIX_RANK")  # fmt: skip
LAUNCH_PREFIXES = ("SLURM_", "LSB_", "JSM_")
DDP = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]
NODES = ["trainer=ddp", "trainer.num_nodes=2", "trainer.devices=1", "trainer.accelerator=cpu"]


@pytest.fixture
def shell_env(monkeypatch) -> dict[str, str]:
    """This process's environment as a shell gives it, without any launcher's variables (a dict in place of
    `os.environ`, which Lightning's and torch's detections read through `os`)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    monkeypatch.setattr(os, "environ", env)
    return env


# ---- launches ----------------------------------------------------------------------------------------------------
def test_several_nodes_without_a_launcher_are_refused_naming_the_key(tmp_path, shell_env):
    cfg = make_cfg(tmp_path, NODES)
    with pytest.raises(ValueError, match=r"^trainer\.num_nodes=2, but no launcher started this process") as err:
        check_launch(cfg)
    assert "\n" not in str(err.value)
    check_launch(make_cfg(tmp_path, DDP))  # one node: Lightning starts its processes itself


@pytest.mark.parametrize(
    ("variables", "name"),
    [
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "1",
          "LOCAL_WORLD_SIZE": "1"}, "torchrun"),
        ({"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "1"}, "SLURM"),
        ({"LSB_JOBID": "7", "LSB_DJOB_RANKFILE": "/tmp/ranks", "JSM_NAMESPACE_LOCAL_RANK": "0",
          "JSM_NAMESPACE_SIZE": "2"}, "LSF"),
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}, "Lightning"),
    ],
)  # fmt: skip
def test_each_launcher_lets_several_nodes_start(tmp_path, shell_env, variables, name):
    shell_env.update(variables)
    assert launcher() == name
    check_launch(make_cfg(tmp_path, NODES))


def test_an_interactive_slurm_shell_is_no_launcher(tmp_path, shell_env):
    """Lightning does not take `srun --job-name=interactive` (or bash) for SLURM's launch, so neither does the check."""
    shell_env.update({"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "interactive"})
    assert launcher() is None
    with pytest.raises(ValueError, match="trainer.num_nodes=2"):
        check_launch(make_cfg(tmp_path, NODES))


def test_mpi_is_asked_only_under_an_mpi_launcher(monkeypatch, shell_env):
    """Lightning's MPI detection initialises MPI (mpi4py): asked only where an MPI launcher set its variables."""

    def detect():
        raise AssertionError("asked without an MPI launcher's variables")

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(detect))
    assert launcher() is None
    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(lambda: True))
    shell_env["OMPI_COMM_WORLD_SIZE"] = "2"
    assert launcher() == "MPI"


@pytest.mark.parametrize(
    ("overrides", "variables", "named"),
    [
        ([], {"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1 and WORLD_SIZE=2"),
        ([], {"LOCAL_RANK": "1"}, "LOCAL_RANK=1"),
        ([], {"WORLD_SIZE": "4"}, "WORLD_SIZE=4"),
        (DDP, {"RANK": "0"}, "RANK=0"),  # every process Lightning starts would inherit it and take itself for rank 0
        (DDP, {"LOCAL_RANK": "0"}, "LOCAL_RANK=0"),  # Lightning would start no process and wait for them
    ],
)
def test_rank_variables_left_in_the_environment_are_refused(tmp_path, shell_env, overrides, variables, named):
    shell_env.update(variables)
    processes = 2 if overrides else 1
    with pytest.raises(ValueError) as err:
        check_launch(make_cfg(tmp_path, overrides))
    message = str(err.value)
    assert message.startswith(f"trainer.devices x trainer.num_nodes = {processes}, but the environment sets {named}")
    assert "no launcher (torchrun, SLURM, LSF, MPI) started this process: unset" in message and "\n" not in message


def test_a_process_of_one_node_run_as_lightning_starts_it_passes(tmp_path, shell_env, monkeypatch):
    """Lightning's own launcher (trainer=ddp trainer.devices=2 on one node), its `Popen` recorded: the process it
    starts gets LOCAL_RANK=1 and WORLD_SIZE=2, and passes; so does the one that started it, before and after."""
    cfg = make_cfg(tmp_path, DDP)
    check_launch(cfg)
    started = []

    class Recorded:
        @staticmethod
        def Popen(command, env=None, cwd=None):  # noqa: N802 - subprocess's name
            started.append(dict(env))
            return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess_script, "subprocess", Recorded)
    subprocess_script._SubprocessScriptLauncher(
        LightningEnvironment(), num_processes=2, num_nodes=1
    )._call_children_scripts()
    assert len(started) == 1 and started[0]["LOCAL_RANK"] == "1" and started[0]["WORLD_SIZE"] == "2"
    check_launch(cfg)  # rank 0, its environment as the launcher left it
    monkeypatch.setattr(os, "environ", started[0])
    check_launch(cfg)  # rank 1


def test_several_nodes_without_a_launcher_exit_2_before_anything_loads(tmp_path, shell_env):
    start = time.monotonic()
    result = cli(f"hydra.run.dir={tmp_path}/run", *TINY, *NODES, cwd=tmp_path)
    assert_clean_failure(result, "trainer.num_nodes=2, but no launcher started this process", code=2)
    assert time.monotonic() - start < 30


def test_stray_rank_variables_exit_2_naming_them(tmp_path, shell_env):
    shell_env.update({"RANK": "1", "WORLD_SIZE": "2"})
    result = cli(f"hydra.run.dir={tmp_path}/run", *TINY, cwd=tmp_path)
    assert_clean_failure(result, "the environment sets RANK=1 and WORLD_SIZE=2", "unset them", code=2)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_the_real_command_with_several_nodes_and_no_launcher_exits_2_fast(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)}
    env.pop("HYDRA_FULL_ERROR", None)
    env["PYTHONPATH"] = str(ROOT)
    start = time.monotonic()
    result = cli_run(f"hydra.run.dir={tmp_path}/run", *TINY, *NODES, cwd=tmp_path, env=env, timeout=120)
    assert_clean_failure(result, "error: trainer.num_nodes=2, but no launcher started this process", code=2)
    assert len(result.stderr.strip().splitlines()) == 1
    assert time.monotonic() - start < 60  # torch's own rendezvous would wait 30 minutes


# ---- bounded waits -----------------------------------------------------------------------------------------------
def test_the_strategy_takes_the_timeout_from_the_setting(tmp_path):
    bound = datetime.timedelta(seconds=42)
    ddp = bounded_strategy(make_cfg(tmp_path, [*DDP, "trainer.collective_timeout_s=42"]))
    assert isinstance(ddp, DDPStrategy) and ddp._timeout == bound
    assert ddp._start_method == "popen"  # Lightning's `ddp` otherwise, as its registry builds it
    fsdp = bounded_strategy(
        make_cfg(tmp_path, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.collective_timeout_s=42"])
    )
    assert isinstance(fsdp, FullyShardedStrategy) and fsdp._timeout == bound
    auto = bounded_strategy(make_cfg(tmp_path, ["trainer.devices=2", "trainer.collective_timeout_s=42"]))
    assert isinstance(auto, DDPStrategy) and auto._timeout == bound  # Lightning's choice for several processes
    assert bounded_strategy(make_cfg(tmp_path, [])) is None  # one process: no collective, Lightning's own choice
    default = bounded_strategy(make_cfg(tmp_path, DDP))
    assert default._timeout == default_pg_timeout == datetime.timedelta(minutes=30)  # torch's own default


def test_the_trainer_is_built_with_the_bounded_strategy(tmp_path):
    cfg = make_cfg(tmp_path, [*DDP, "trainer.collective_timeout_s=42"])
    assert "collective_timeout_s" not in trainer_node(cfg) and "collective_timeout_s" in cfg.trainer
    trainer = build_trainer(cfg, 1, [], [])
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._timeout == datetime.timedelta(seconds=42)
    assert trainer.num_devices == 2 and trainer.default_root_dir == cfg.paths.output_dir


def test_the_setting_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"^trainer\.collective_timeout_s must be > 0 \(got 0\)"):
        validate(make_cfg(tmp_path, ["trainer.collective_timeout_s=0"]), platform=False)


STALLED = [*TINY, *DDP, "trainer.max_epochs=2", "trainer.collective_timeout_s=10",
           "+callbacks.stall._target_=tests.helpers.StallRank", "+callbacks.stall.rank=1",
           "+callbacks.stall.at_round=0", "+callbacks.stall.seconds=120"]  # fmt: skip


def stalled_run(run_dir: Path, signal_after_stall: bool = False) -> tuple[subprocess.CompletedProcess, float, int]:
    """A 2-process run whose rank 1 stops for 120 s at round 0 (its collectives wait at most 10 s); with
    `signal_after_stall`, SIGTERM reaches rank 0 while it waits. (result, seconds, rank 1's pid)."""
    run_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    start = time.monotonic()
    proc = cli_popen(f"hydra.run.dir={run_dir}", *STALLED, f"+callbacks.stall.directory={run_dir}", cwd=ROOT, env=env)
    try:
        if signal_after_stall:
            while not (run_dir / "stalled1").is_file() and proc.poll() is None and time.monotonic() - start < 200:
                time.sleep(0.2)
            time.sleep(2)  # rank 0 is at its next collective by now
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return result, time.monotonic() - start, int((run_dir / "stalled1").read_text())


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_collective_that_waits_too_long_stops_the_run_in_one_line(tmp_path):
    """Rank 1 stops for 120 s; rank 0 waits at its next collective for 10 s, then the run stops: exit 1, one line
    naming trainer.collective_timeout_s, rank 1 ended with it rather than left sleeping."""
    result, seconds, stalled = stalled_run(tmp_path / "run")
    assert_clean_failure(result, "trainer.collective_timeout_s=10", code=1)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: training stopped: a collective operation waited"), lines
    assert seconds < 110  # within the bound plus start-up, not the stalled rank's 120 s
    assert gone(stalled)


@pytest.mark.slow
def test_sigterm_during_a_collective_that_never_completes_stops_within_the_bound(tmp_path):
    """SIGTERM while rank 0 waits at a collective: the graceful stop can act only when the wait returns, which the
    bound makes it do; the run ends with the same line, and rank 1 with it."""
    result, seconds, stalled = stalled_run(tmp_path / "run", signal_after_stall=True)
    assert_clean_failure(result, "trainer.collective_timeout_s=10", code=1)
    assert "SIGTERM received" in result.stderr
    assert seconds < 110
    assert gone(stalled)


@pytest.mark.slow
def test_a_group_made_later_takes_the_runs_bound():
    """torch's `new_group` takes its own default (30 min), not the world's: the overlap worker's group is given the
    run's bound (`group_timeout`), read back from torch's own group options."""
    code = (
        "import datetime, torch, torch.distributed as dist\n"
        "from grpo_lightning.distributed import group_timeout\n"
        "assert group_timeout() is None\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1,"
        " timeout=datetime.timedelta(seconds=7))\n"
        "group = dist.new_group(backend='gloo', timeout=group_timeout())\n"
        "print(group_timeout().total_seconds(), group._get_backend(torch.device('cpu')).options._timeout)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["7.0", "0:00:07"]
