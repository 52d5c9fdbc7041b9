"""CLI: `python -m grpo_lightning [overrides]` (Hydra). Only wraps `train(cfg)` and turns errors into messages.

Config and input mistakes (ValueError, OmegaConf key errors) print `error: ...` naming the key and exit 2; a run
the non-finite guard stopped exits 1; a graceful Ctrl-C / SIGTERM stop exits 128 + the signal number. None of
them prints a traceback unless HYDRA_FULL_ERROR=1.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from grpo_lightning.interrupt import RunInterrupted
from grpo_lightning.train import TrainingStopped, train


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except (ValueError, OmegaConfBaseException, TrainingStopped, RunInterrupted) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        prefix = "" if isinstance(err, RunInterrupted) else "error: "
        print(f"{prefix}{describe(err)}", file=sys.stderr)
        if isinstance(err, RunInterrupted):
            sys.exit(128 + err.signum)
        sys.exit(1 if isinstance(err, TrainingStopped) else 2)
    return metrics.get("train/reward_mean")


def describe(err: BaseException) -> str:
    """One line (two for stops): OmegaConf errors get their full key instead of their multi-line report."""
    if isinstance(err, OmegaConfBaseException):
        key = getattr(err, "full_key", None)
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"config key {key}: {first_line}" if key else first_line
    return str(err)


if __name__ == "__main__":
    main()
