"""How the run's processes start and wait for each other (docs/multiprocess.md).

Launch: `check_launch` runs before anything loads and compares what started this process with
`trainer.devices x trainer.num_nodes`. Lightning starts the processes of one node itself; the processes of several
nodes must be started by a launcher on every node (torchrun, SLURM's srun, LSF's jsrun, mpirun: the cluster
environments Lightning detects, in its own order), or by hand with Lightning's variables (MASTER_ADDR, MASTER_PORT
and NODE_RANK on every node). Without one, a run of several nodes would start this node's processes and wait, with
no word, for nodes nothing starts; and a rank variable left in a shell's environment (RANK=1) makes a run that no
launcher started take itself for another process than rank 0, which writes no record, logs or checkpoints. Both
are refused in one line. A process Lightning started for a run of one node (LOCAL_RANK >= 1, with MASTER_ADDR,
MASTER_PORT and NODE_RANK) is one of the run's own and passes.

Waits: every collective the run issues (gradient all-reduces, FSDP's gathers, the round's summaries) waits at most
`trainer.collective_timeout_s` for the other processes. `bounded_strategy` gives that bound to the strategy that
creates the process group (torch's `init_process_group(timeout=...)`, which also bounds the rendezvous), whether
the config names the strategy (`ddp`, Lightning's choice for several processes) or builds it (trainer=fsdp). A
collective that times out, most often because the processes went out of step, stops the run with one line naming
the setting (`collective_timed_out`), and the processes Lightning started are ended with it.

The default, 1800 s, is torch's own (`default_pg_timeout`, which Lightning passes): no run that finished before is
cut short. It exceeds the longest wait the run bounds elsewhere and that other processes may spend at a collective
(a vLLM server's start, `generator.startup_timeout_s` = 900 s; a request, 600 s); lower it for quicker failures in
short runs.
"""

from __future__ import annotations

import datetime
import inspect
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from lightning.fabric.plugins.environments import (
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.app.build import build
from grpo_lightning.app.run_settings import TrainerKeys
from grpo_lightning.errors import TrainingStopped
from grpo_lightning.generation.placement import world_size
from grpo_lightning.schema import target_class

TIMEOUT_KEY = "collective_timeout_s"
"""`trainer.collective_timeout_s`: read here, never passed to Lightning's Trainer."""

MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
"""Variables an MPI launcher sets; only then is Lightning's MPI detection asked (it initialises MPI)."""

LIGHTNING_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
"""What Lightning's own launch sets in the processes it starts, and what a launch by hand sets on every node."""


# ---- launch ------------------------------------------------------------------------------------------------------
def launcher() -> str | None:
    """What started this process, as Lightning's cluster environments detect it from the environment (torchrun
    first, as Lightning orders them: it can run inside SLURM), then a launch with Lightning's variables; None for
    a process started from a shell."""
    env = os.environ
    if TorchElasticEnvironment.detect():
        return "torchrun"
    if SLURMEnvironment.detect():
        return "SLURM"
    if LSFEnvironment.detect():
        return "LSF"
    if any(name in env for name in MPI_VARIABLES) and MPIEnvironment.detect():
        return "MPI"
    if all(name in env for name in LIGHTNING_VARIABLES):
        return "Lightning"
    return None


def stray_rank_variables(env: Mapping[str, str], processes: int) -> dict[str, str]:
    """The rank variables in `env` that a process no launcher started must not have, with their values: a rank or
    local rank other than 0 (Lightning would make this process that rank); with several processes, a rank or
    local rank at all (Lightning would take the processes for started by a launcher and start none, or give each
    of its own the rank 0); a world size other than `processes`."""
    stray = {}
    for name in ("RANK", "LOCAL_RANK"):
        if name in env and (env[name].strip() != "0" or processes > 1):
            stray[name] = env[name]
    if "WORLD_SIZE" in env and env["WORLD_SIZE"].strip() != str(processes):
        stray["WORLD_SIZE"] = env["WORLD_SIZE"]
    return stray


def check_launch(cfg: DictConfig) -> None:
    """This process's launcher against `trainer.devices x trainer.num_nodes` (module docstring): one ValueError
    naming the key or the variables when nothing would start the other nodes, or when rank variables left in the
    environment would make this process another rank than the one it is."""
    if launcher() is not None:
        return
    processes, nodes = world_size(cfg), int(cfg.trainer.get("num_nodes", 1) or 1)
    stray = stray_rank_variables(os.environ, processes)
    if stray:
        names = " and ".join(f"{name}={value}" for name, value in stray.items())
        raise ValueError(
            f"trainer.devices x trainer.num_nodes = {processes}, but the environment sets {names} and no launcher "
            f"(torchrun, SLURM, LSF, MPI) started this process: unset {'it' if len(stray) == 1 else 'them'} "
            "(Lightning numbers the processes from them: a process would take another rank than its own, and only "
            "rank 0 writes the record, logs and checkpoints, or wait for processes nothing starts)"
        )
    if nodes > 1:
        raise ValueError(
            f"trainer.num_nodes={nodes}, but no launcher started this process (torchrun, SLURM's srun, LSF's jsrun, "
            "mpirun, or MASTER_ADDR, MASTER_PORT and NODE_RANK set on every node), so nothing starts the other "
            "nodes' processes and this one would wait for them: start the run on every node "
            "(docs/multiprocess.md#multi-node), or set trainer.num_nodes=1"
        )


# ---- bounded waits -----------------------------------------------------------------------------------------------
def collective_timeout(trainer: DictConfig) -> datetime.timedelta:
    """`trainer.collective_timeout_s` as the timeout torch's process groups take."""
    return datetime.timedelta(seconds=float(trainer.get(TIMEOUT_KEY, TrainerKeys.collective_timeout_s)))


def takes_timeout(cls: type) -> bool:
    """Whether `cls(timeout=...)` reaches a constructor with a `timeout` parameter (through `**kwargs` too)."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        if "timeout" in parameters:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def bounded_strategy(cfg: DictConfig):
    """The `trainer.strategy` of a run of several processes, built with `trainer.collective_timeout_s` as its
    process group's timeout: a strategy object (`_target_`, trainer=fsdp) built with it, a Lightning strategy
    name (`ddp`, or `auto`, which is `ddp` for several processes) built from Lightning's registry with it. None
    where the strategy is left to Lightning: one process (no collective), a strategy without a timeout, or a
    node that sets its own `timeout`."""
    trainer = cfg.trainer
    timeout = collective_timeout(trainer)
    spec = trainer.get("strategy", "auto")
    if OmegaConf.is_dict(spec):
        cls = target_class(spec.get("_target_"))
        if cls is None or "timeout" in spec or not takes_timeout(cls):
            return None
        return build(spec, timeout=timeout)
    name = "auto" if spec is None else str(spec)
    if name == "auto":
        if world_size(cfg) == 1:
            return None
        name = "ddp_fork" if _IS_INTERACTIVE else "ddp"  # Lightning's own choice for several processes
    if name not in StrategyRegistry:
        return None
    entry = StrategyRegistry[name]
    if not takes_timeout(entry["strategy"]):
        return None
    return entry["strategy"](**entry["init_params"], timeout=timeout)


def trainer_node(cfg: DictConfig) -> DictConfig:
    """The `trainer` node as Lightning's Trainer takes it: without `collective_timeout_s`, which is this module's."""
    node = cfg.trainer.copy()  # keeps its parent: ${paths.output_dir} still resolves, errors name `trainer`
    if TIMEOUT_KEY in node:
        with_flag = OmegaConf.is_struct(node)
        OmegaConf.set_struct(node, False)
        node.pop(TIMEOUT_KEY)
        OmegaConf.set_struct(node, with_flag)
    return node


def collective_timed_out_stop(err: BaseException, cfg: DictConfig, last: Path) -> TrainingStopped:
    """The one line a run stops with when a collective waited longer than `trainer.collective_timeout_s`."""
    seconds = cfg.trainer.get(TIMEOUT_KEY, TrainerKeys.collective_timeout_s)
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    resume = last if last.is_file() else "<none yet: start again>"
    return TrainingStopped(
        f"training stopped: a collective operation waited longer than trainer.collective_timeout_s={seconds} for "
        f"the other training processes, which were out of step or stalled ({reason}); resume: python -m "
        f"grpo_lightning <same overrides> ckpt_path={resume}"
    )


def end_started_processes(trainer) -> None:
    """End the processes Lightning's launcher started for this run (on rank 0 of a run of one node), as Lightning
    does after a Ctrl-C: a stalled one would otherwise outlive the run it belongs to."""
    launched = getattr(trainer.strategy, "launcher", None)
    if isinstance(launched, _SubprocessScriptLauncher):
        launched.kill(signal.SIGKILL)
