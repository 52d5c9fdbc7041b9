"""CLI: `python -m grpo_lightning [overrides]` (Hydra). Only wraps `train(cfg)`."""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from grpo_lightning.train import train


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except ValueError as err:  # config mistakes: one line naming the key, no traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return metrics.get("train/reward_mean")


if __name__ == "__main__":
    main()
