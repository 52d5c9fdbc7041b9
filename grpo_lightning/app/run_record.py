"""The record of a run Hydra started: `.hydra/config.yaml` (the composed config as written), `hydra.yaml` and
`overrides.yaml` (what a sweep summary reads), and the job's log file, in the run's directory.

Hydra writes them into its run directory before the task starts, so a run refused for pointing at another run's
directory (still running, or finished) would already have overwritten that run's record and appended to its log.
The config therefore turns Hydra's writing off (`hydra.output_subdir: null`, no file handler on the root logger),
and the run writes the same files here once it holds the directory's lock and has been accepted (app/train.py),
into `paths.output_dir`: the directory it was accepted for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""Hydra's default job log format."""


def write_run_record(cfg: DictConfig) -> None:
    """Write the run's Hydra record and start its log file in `cfg.paths.output_dir` (nothing when the run was not
    started by Hydra: `train(cfg)` called in-process)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg
    output_dir = Path(cfg.paths.output_dir)
    record = output_dir / ".hydra"
    record.mkdir(parents=True, exist_ok=True)
    (record / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (record / "hydra.yaml").write_text(OmegaConf.to_yaml(hydra_cfg))
    (record / "overrides.yaml").write_text(OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))
    handler = logging.FileHandler(output_dir / f"{hydra_cfg.hydra.job.name}.log")  # Hydra resets it per job
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


SECRET_KEYS = (("generator", "api_key"),)
"""Keys whose values come from the environment and must stay out of every record and tracker."""


def without_secrets(params: dict) -> dict:
    """The resolved config `params` with each of `SECRET_KEYS` that is set replaced by '<set>' (in place)."""
    for *parents, leaf in SECRET_KEYS:
        node = params
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None:
            node[leaf] = "<set>"
    return params
