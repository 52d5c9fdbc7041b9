"""Where a run computes: the trainer's processes and CUDA devices, as `trainer.*` sets them (Lightning's rules), and
the vLLM engine's GPU (`generator.device`, docs/vllm.md, Layouts).

Read from the composed config before anything is built (the config check, the memory estimate, train.py, which
gives every engine the trainer's devices), and by the vLLM engine when it picks its GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch
from omegaconf import DictConfig, OmegaConf


def world_size(cfg: DictConfig) -> int:
    """Processes the trainer will start: devices (a count or a list of ids) x nodes."""
    return trainer_world_size(cfg.trainer)


def trainer_world_size(trainer: DictConfig) -> int:
    """`world_size` of the `trainer` node alone (the `own_engine_process` resolver gets just that node)."""
    devices = trainer.get("devices", 1)
    if OmegaConf.is_list(devices):
        count = len(devices)
    elif str(devices).lstrip("-").isdigit() and int(devices) > 0:
        count = int(devices)
    else:  # "auto" or -1: every GPU when the trainer will use GPUs, else one process
        gpu = trainer.get("accelerator") in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        count = torch.cuda.device_count() if gpu else 1
    return count * int(trainer.get("num_nodes", 1) or 1)


SHARDED_STRATEGY = "grpo_lightning.sharding.FullyShardedStrategy"
"""trainer=fsdp's strategy: FSDP2 over every process (grpo_lightning/sharding.py)."""


def shards_weights(trainer: DictConfig) -> bool:
    """Whether the `trainer` node shards the policy over its processes (trainer=fsdp)."""
    strategy = trainer.get("strategy")
    return OmegaConf.is_dict(strategy) and strategy.get("_target_") == SHARDED_STRATEGY


def trainer_devices(cfg: DictConfig) -> tuple[int, ...]:
    """The CUDA indices the trainer will train on (trainer.accelerator and trainer.devices); () on the CPU."""
    devices = cfg.trainer.get("devices", 1)
    devices = list(devices) if OmegaConf.is_list(devices) else devices
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return trainer_cuda_devices(cfg.trainer.get("accelerator"), devices, count)


def trainer_cuda_devices(accelerator: str | None, devices, cuda_count: int) -> tuple[int, ...]:
    """The CUDA indices Lightning will train on (trainer.accelerator, trainer.devices), () on the CPU.

    A count n takes cuda:0..n-1 (Lightning's rule), a list takes its ids, 'auto' / -1 every visible GPU.
    """
    if accelerator not in ("gpu", "cuda", "auto") or (accelerator == "auto" and cuda_count == 0):
        return ()
    if isinstance(devices, list | tuple):
        return tuple(int(d) for d in devices)
    if devices in ("auto", -1, "-1"):
        return tuple(range(cuda_count))
    return tuple(range(int(devices)))


def engine_cuda_index(
    device: str | None, trainer_devices: Sequence[int], current: int = 0, local_rank: int | None = None
) -> int:
    """Where a CUDA engine runs, by the placement rules (docs/vllm.md, Layouts).

    - `generator.device: null` colocates the engine with the trainer: on the GPU of this training process
      (`trainer.devices=[1]` puts both on cuda:1; with several processes on a node, process `local_rank` trains on
      `trainer_devices[local_rank]`, Lightning's rule, and its engine goes there too), or on `current` when the
      trainer is not on a GPU. `local_rank` defaults to the launcher's `LOCAL_RANK` (0 when unset).
    - `generator.device: cuda:N` is the separate layout: cuda:N must not be one of the trainer's GPUs, where the
      engine, with sleep mode off, would keep its memory share while the trainer trains beside it.
    """
    index = parse_device(device)
    if index is None:
        if not trainer_devices:
            return current
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return trainer_devices[local_rank % len(trainer_devices)]
    if index in trainer_devices:
        listed = ", ".join(f"cuda:{i}" for i in trainer_devices)
        raise ValueError(
            f"generator.device={device} is one of the trainer's GPUs ({listed}, from trainer.devices): give the "
            "engine a GPU of its own (e.g. generator.device=cuda:0 trainer.devices=[1]), or colocate it with "
            "generator.device=null (sleep mode frees its memory while a round trains)"
        )
    return index


def parse_device(device: str | None) -> int | None:
    """`generator.device` -> CUDA index; None keeps the current device (and 'cpu' has none)."""
    if device is None or device == "cpu":
        return None
    match = re.fullmatch(r"cuda(?::(\d+))?", str(device))
    if match is None:
        raise ValueError(f"generator.device must be null, 'cpu' or 'cuda:N' (got {device!r})")
    return int(match.group(1) or 0)
