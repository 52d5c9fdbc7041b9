"""CLI: `python -m grpo_lightning [overrides]` (Hydra). Only wraps `train(cfg)` and turns errors into messages.

Config and input mistakes (ValueError, OmegaConf key errors) print `error: ...` naming the key and exit 2; a run
the non-finite or divergence guard, a failed engine or server, or a timed-out collective stopped exits 1; a
graceful Ctrl-C / SIGTERM stop exits 128 + the signal number. None of them prints a traceback unless
HYDRA_FULL_ERROR=1. A run directory that cannot be created is checked here, before Hydra creates it (Hydra's own
failure is a traceback); a dry run leaves none behind.
"""

from __future__ import annotations

from grpo_lightning.openmp import set_openmp_wait

set_openmp_wait()  # before torch loads: GNU OpenMP reads its wait policy once (grpo_lightning/openmp.py)

import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from grpo_lightning.app.train import train  # noqa: E402
from grpo_lightning.errors import RunInterrupted, TrainingStopped  # noqa: E402
from grpo_lightning.moved_keys import check_moved_overrides  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        code, metrics = run(cfg)
    finally:
        if cfg.get("dry_run"):
            remove_fresh_run_dir()
    if code:
        sys.exit(code)
    return metrics.get("train/reward_mean")


def run(cfg: DictConfig) -> tuple[int, dict[str, float]]:
    """`train(cfg)` as the CLI runs it: (exit code, final metrics); a mistake is printed as one line on stderr."""
    try:
        return 0, train(cfg)
    except (ValueError, OmegaConfBaseException, TrainingStopped, RunInterrupted) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        prefix = "" if isinstance(err, RunInterrupted) else "error: "
        if not (isinstance(err, TrainingStopped) and err.printed):
            print(f"{prefix}{describe(err)}", file=sys.stderr)
        if isinstance(err, RunInterrupted):
            return 128 + err.signum, {}
        return (1 if isinstance(err, TrainingStopped) else 2), {}


def describe(err: BaseException) -> str:
    """One line (two for stops): OmegaConf errors get their full key instead of their multi-line report; a config
    mistake in a value the chosen recipe set, not the command line, says so (`recipe_origin`)."""
    if isinstance(err, OmegaConfBaseException):
        key = getattr(err, "full_key", None)
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"config key {key}: {first_line}" if key else first_line
    if isinstance(err, ValueError):
        return str(err) + recipe_origin(str(err))
    return str(err)


LEADING_KEY = re.compile(r"(?P<key>[a-z_]\w*(?:\.[a-z_]\w*)+)\b")


def recipe_origin(message: str) -> str:
    """' (set by experiment=<name> ...)' when the key a message begins with was set by the recipe's file and not on
    the command line, else ''. A value the user never typed is then traced to where it came from."""
    match = LEADING_KEY.match(message)
    if match is None or not HydraConfig.initialized():
        return ""
    hydra_cfg = HydraConfig.get()
    recipe = hydra_cfg.runtime.choices.get("experiment")
    key = match["key"]
    recipe_file = Path(__file__).parent / "conf" / "experiment" / f"{recipe}.yaml"
    if recipe in (None, "null") or not recipe_file.is_file():
        return ""
    typed = {override.lstrip("~+").split("=", 1)[0] for override in hydra_cfg.overrides.task}
    if any(_related(key, t) for t in typed) or OmegaConf.select(OmegaConf.load(recipe_file), key, default=None) is None:
        return ""
    return f" (the value is set by experiment={recipe}, conf/experiment/{recipe}.yaml: override {key} to change it)"


def _related(key: str, typed: str) -> bool:
    """Whether an override of `typed` set `key` or part of it: the same key, a key under it, or a node above it
    (a message naming `reward.terms.payoff` after `reward.terms.payoff.discount=0` was typed)."""
    return key == typed or typed.startswith(f"{key}.") or key.startswith(f"{typed}.")


def remove_fresh_run_dir() -> None:
    """Undo the run directory Hydra made for a dry run: only when it holds nothing but Hydra's own files.

    Hydra creates the job's directory, its `.hydra/` and its log file before the task runs. A directory with
    anything else in it (an earlier run's checkpoints, say) is left as it is; emptied parents below the working
    directory (`outputs/<date>/`) go too.
    """
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    own = {hc.output_subdir, f"{hc.job.name}.log"} - {None}
    if not run_dir.is_dir() or any(p.name not in own for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd = Path.cwd().resolve()
    parent = run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def check_run_dir(argv: list[str]) -> str | None:
    """The error for a `hydra.run.dir=...` override Hydra could not create, or None (default dirs: Hydra's)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    if not given or "${" in given[-1] or "-m" in argv or "--multirun" in argv:
        return None
    directory = Path(given[-1].strip("\"'")).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"hydra.run.dir: cannot create {directory} ({err.strerror}); choose a writable directory"
    return None


OPEN_MAPPINGS = ("data.dataset.task_config.",)
"""Nodes whose keys are the user's to name (a reasoning-gym task's own keys): `key=value` under one adds the key."""


def with_open_mappings(argv: list[str]) -> list[str]:
    """The overrides with `++` before a plain `key=value` under an open mapping: Hydra refuses a key its config
    does not have yet without `+`, and `++` adds it or replaces what a recipe set (`experiment=learn_arith`)."""
    return [f"++{arg}" if arg.startswith(OPEN_MAPPINGS) and "=" in arg else arg for arg in argv]


def cli() -> None:
    """`main`, after two checks Hydra would otherwise answer with a traceback or a message that names no key: an
    override of a moved key (`reward.format_bonus=...`) and a `hydra.run.dir` that cannot be created; a plain
    override under an open mapping becomes the `++` override Hydra needs (`with_open_mappings`)."""
    problem = check_moved_overrides(sys.argv[1:]) or check_run_dir(sys.argv[1:])
    if problem is not None and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = with_open_mappings(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
