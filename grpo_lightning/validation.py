"""Config checks that no constructor makes, run before any data or model is loaded.

Each failure is a ValueError whose message names the config key and what to do (the CLI prints it as one line).
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.reward_pipeline import check_moved_keys


def validate(cfg: DictConfig) -> None:
    """Checks of keys no constructor sees before the model is loaded (each error names its key)."""
    check_moved_keys(cfg)  # reward.format_bonus, loss.scale_rewards: a one-line message naming the new key
    SamplingConfig(**{f.name: cfg.generator[f.name] for f in fields(SamplingConfig)})  # other groups interpolate it
    target = cfg.optim.optimizer.get("_target_")
    try:
        get_class(target)
    except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
        raise ValueError(f"optim.optimizer._target_: cannot import {target!r}") from None
    lr = cfg.optim.optimizer.get("lr")
    if not (is_number(lr) and lr >= 0 and math.isfinite(lr)):  # 0: a control run that never updates
        raise ValueError(f"optim.optimizer.lr must be a finite number >= 0 (got {lr!r})")
    for key, value in [
        ("trainer.max_epochs", cfg.trainer.max_epochs),
        ("checkpoint.every_n_rounds", cfg.checkpoint.every_n_rounds),
        ("guard.max_consecutive_skipped_steps", cfg.guard.max_consecutive_skipped_steps),
    ]:
        if not (is_int(value) and value >= 1):
            raise ValueError(f"{key} must be an integer >= 1 (got {value!r})")
    if not is_int(cfg.seed):
        raise ValueError(f"seed must be an integer (got {cfg.seed!r})")
    processes = world_size(cfg)
    if str(cfg.generator.get("_target_", "")).endswith("VLLMGenerator") and processes > 1:
        raise ValueError(
            f"generator=vllm runs one in-process engine and cannot be combined with several training processes yet "
            f"(trainer.devices x trainer.num_nodes = {processes}); train on one device (colocated, or "
            "generator.device=cuda:0 trainer.devices=[1]), or use generator=hf with trainer=ddp"
        )
    check_writable(Path(cfg.paths.output_dir))
    previous = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if cfg.get("ckpt_path") is None and previous.exists():
        raise ValueError(
            f"paths.output_dir {previous.parent.parent} already holds a run ({previous}); resume it with "
            "ckpt_path=last, or start a new run in another directory (hydra.run.dir)"
        )


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_writable(directory: Path) -> None:
    """Fail before any work when the run could not save its checkpoints and logs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"paths.output_dir: cannot write to {directory} ({err.strerror}); choose another hydra.run.dir"
        ) from None


def world_size(cfg: DictConfig) -> int:
    """Processes the trainer will start: devices (a count or a list of ids) x nodes."""
    devices = cfg.trainer.get("devices", 1)
    if OmegaConf.is_list(devices):
        count = len(devices)
    elif str(devices).lstrip("-").isdigit() and int(devices) > 0:
        count = int(devices)
    else:  # "auto" or -1: every GPU when the trainer will use GPUs, else one process
        gpu = cfg.trainer.get("accelerator") in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        count = torch.cuda.device_count() if gpu else 1
    return count * int(cfg.trainer.get("num_nodes", 1) or 1)
