"""Checkpoints a kill cannot corrupt, and what a resume needs to continue bit for bit.

- `LastCheckpoint` writes `checkpoints/last.ckpt` at the end of every round. Lightning's ModelCheckpoint only
  refreshes `last.ckpt` when it also saves a periodic checkpoint, which would lose up to `every_n_rounds` rounds.
- `AtomicCheckpointIO` writes `x.ckpt` as a hidden temporary file in the same folder, fsyncs it and renames it
  over the old one (`os.replace` is atomic on POSIX), so SIGKILL mid-write leaves the previous `last.ckpt`.
- `capture_rng` / `restore_rng`: torch (CPU and CUDA), Python and NumPy generator states. Lightning does not
  save them; the rollout callback stores them with the round in progress (see generation/callback.py).
- `resolve_ckpt_path` / `check_resumable`: the `ckpt_path` config key, turned into a file that exists and was
  written for the same model and LoRA settings, or a ValueError that says what to do.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

log = logging.getLogger(__name__)

LAST = "last.ckpt"


class LastCheckpoint(Checkpoint):
    """`<dirpath>/last.ckpt` after every round.

    A `Checkpoint` subclass, so Lightning runs it after every other callback's round-end hook: the file then
    holds the next round's rollouts and the RNG states after generating them (see generation/callback.py).
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # every rank calls it; the strategy writes on rank 0
        trainer.save_checkpoint(self.dirpath / LAST, weights_only=False)


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` into a temporary file, fsync, then rename over the target (never a half-written file)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (a power cut right after must not bring back the old file)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- RNG state -------------------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Every generator a round draws from, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


# ---- resuming --------------------------------------------------------------------------------------------------
def resolve_ckpt_path(ckpt_path: str | None, output_dir: str | Path) -> Path | None:
    """`ckpt_path`: null (fresh run), `last` (this output dir's last.ckpt), a run dir, or a .ckpt file."""
    if ckpt_path is None:
        return None
    if str(ckpt_path) == "last":
        path = Path(output_dir) / "checkpoints" / LAST
        if not path.is_file():
            raise ValueError(
                f"ckpt_path=last: no checkpoint at {path}. Point ckpt_path at the run to resume "
                "(its directory or a .ckpt file), or rerun in its directory with hydra.run.dir=<run dir>"
            )
        return path
    path = Path(str(ckpt_path)).expanduser()
    for candidate in (path, path / "checkpoints" / LAST, path / LAST):
        if candidate.is_file():
            return candidate
    raise ValueError(f"ckpt_path: no checkpoint at {path} (give a .ckpt file or a run directory with checkpoints/)")


def check_resumable(path: Path, policy: nn.Module, run_info: dict[str, Any]) -> None:
    """Raise ValueError unless `path` is a readable checkpoint of this model's trainable weights."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - truncated, not a zip, not a torch file: all the same to the user
        raise ValueError(f"ckpt_path: {path} is not a readable checkpoint ({type(err).__name__}: {err})") from None
    saved_info = checkpoint.get("grpo_lightning", {}).get("run_info", {})
    for key, value in run_info.items():
        if key in saved_info and saved_info[key] != value:
            raise ValueError(
                f"ckpt_path: {path} was written for {key} {saved_info[key]!r}, this run has {value!r}; "
                "resume with the model and model.lora settings of the original run"
            )
    expected = {f"policy.{n}": tuple(p.shape) for n, p in policy.named_parameters() if p.requires_grad}
    found = {k: tuple(v.shape) for k, v in checkpoint.get("state_dict", {}).items()}
    if expected != found:
        missing = sorted(set(expected) - set(found))[:3]
        unexpected = sorted(set(found) - set(expected))[:3]
        reshaped = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])[:3]
        raise ValueError(
            f"ckpt_path: {path} holds other trainable weights than this model (missing {missing}, unexpected "
            f"{unexpected}, other shapes {reshaped}); resume with the original run's model and model.lora settings"
        )
