"""Checkpoints a kill cannot corrupt, and what a resume needs to continue bit for bit.

- `LastCheckpoint` writes `checkpoints/last.ckpt` at the end of every round (`checkpoint.last_every_n_rounds`:
  every N rounds, and always at the round the run stops). Lightning's ModelCheckpoint only refreshes `last.ckpt`
  when it also saves a periodic checkpoint, which would tie it to the `round<NNN>.ckpt` cadence.
- `AtomicCheckpointIO` writes `x.ckpt` as a hidden temporary file in the same folder, fsyncs it and renames it
  over the old one (`os.replace` is atomic on POSIX), so SIGKILL mid-write leaves the previous `last.ckpt`.
- `capture_rng` / `restore_rng` (grpo_lightning/rng.py): torch (CPU and CUDA), Python and NumPy generator
  states. Lightning does not save them; the rollout loop stores them with the round in progress (see rollout_loop.py).
- `resolve_ckpt_path` / `check_resumable`: the `ckpt_path` config key, turned into a file that exists and was
  written for the same model and LoRA settings, or a ValueError that says what to do.
- `fixed_settings` / `check_resume_settings`: the keys a resume may not change (`FIXED_ON_RESUME`) are saved in
  every checkpoint and compared before the model is loaded; any other key (lr, schedule, max_epochs, eval,
  logging) is the new run's, and `GRPOModule.on_train_start` applies the optimizer's to the restored state.
- `RoundCheckpoint` / `LastCheckpoint` write nothing once the non-finite guard found the run diverged, so the
  newest checkpoint on disk is the last one from before the divergence.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from grpo_lightning.schema import integer, problems, setting

log = logging.getLogger(__name__)

LAST = "last.ckpt"


@dataclass(frozen=True)
class CheckpointSettings:
    """The `checkpoint` config node: the cadence of the round files and of last.ckpt."""

    every_n_rounds: int = setting(5, integer(1))
    last_every_n_rounds: int = setting(1, integer(1))


class LastCheckpoint(Checkpoint):
    """`<dirpath>/last.ckpt` after every `every_n_rounds`-th round, and after the round at which the run stops
    (its last round, the token budget, Ctrl-C / SIGTERM, the non-finite guard), so a stopped run always resumes
    from where it stopped.

    Why a cadence: the file holds the trainable weights and the optimizer state. With LoRA that is the adapter
    and its moments (0.1-0.2 GB at 1.5B); in full fine-tuning it is about three times the model (bf16 weights
    plus AdamW's two moments), and writing it after every round can cost more than the round. A crash (not a
    stop) then loses at most `every_n_rounds - 1` rounds.

    A `Checkpoint` subclass, so Lightning runs it after every other callback's round-end hook: the file then
    holds the next round's rollouts and the RNG states after generating them (see rollout_loop.py), and every
    stop decision of the round is already in `trainer.should_stop`.
    """

    def __init__(self, dirpath: str | Path, every_n_rounds: int = 1) -> None:
        found = problems({"last_every_n_rounds": every_n_rounds}, CheckpointSettings, "checkpoint")
        if found:  # the config check's rule and words (a run never gets here with a bad value)
            raise ValueError("; ".join(found))
        self.dirpath = Path(dirpath)
        self.every_n_rounds = every_n_rounds

    def due(self, trainer: L.Trainer) -> bool:
        """Whether the round just trained (`trainer.current_epoch`, 0-based) ends with a write."""
        rounds_done = trainer.current_epoch + 1
        last_round = trainer.max_epochs is not None and trainer.max_epochs >= 0 and rounds_done >= trainer.max_epochs
        return rounds_done % self.every_n_rounds == 0 or last_round or trainer.should_stop

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.diverged:  # keep the previous round's file: it predates the divergence
            return
        if self.due(trainer):
            trainer.save_checkpoint(self.dirpath / LAST, weights_only=False)  # every rank; rank 0 writes


class RoundCheckpoint(ModelCheckpoint):
    """The periodic `round<NNN>.ckpt` files (NNN: the 0-based index of the round just trained, as the
    checkpoint's `epoch`), never written for a round the guard found diverged."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.diverged:
            super().on_train_epoch_end(trainer, pl_module)


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


FIXED_ON_RESUME = (
    "seed",
    "model",
    "loss",
    "variant",
    "data",
    "optim.optimizer._target_",
    "trainer.accumulate_grad_batches",
)
"""Keys a resume may not change, beside the keys that set the variant's group size (`GroupShape.keys`: G is
`variant.num_generations` for variant=grpo): the checkpoint's weights, optimizer state,
pending rollouts and RNG streams were made with them (model and LoRA shape: the weights; seed, data, variant and
its group: the rollouts and the prompt order;
loss: the objective those weights were trained on; optimizer class and steps per round: the optimizer state and
the step count). Everything else (lr and the schedule, max_epochs, eval, logging, checkpoint cadence, guard) may
change, and the new values apply."""
IGNORED_ON_RESUME = ("cache_dir",)
"""Leaf names inside the fixed groups that say where files are, not what is trained."""


def fixed_keys(group_keys: Sequence[str]) -> tuple[str, ...]:
    """The keys (or nodes) a resume may not change: `FIXED_ON_RESUME` and the variant's group keys."""
    return (*FIXED_ON_RESUME, *(key for key in group_keys if key not in FIXED_ON_RESUME))


def fixed_settings(cfg, group_keys: Sequence[str]) -> dict[str, Any]:
    """The values of `fixed_keys(group_keys)` in a config, flattened to dotted keys (stored in every checkpoint)."""
    from omegaconf import OmegaConf

    flat: dict[str, Any] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}.{k}", v)
        elif key.rsplit(".", 1)[-1] not in IGNORED_ON_RESUME:
            flat[key] = value

    for key in fixed_keys(group_keys):
        value = OmegaConf.select(cfg, key, default=None)
        add(key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
    return flat


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at `path`, memory-mapped (tensors are read only when touched), or a ValueError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - truncated, not a zip, not a torch file: all the same to the user
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(
            f"ckpt_path: {path} is not a readable checkpoint ({type(err).__name__}: {first_line})"
        ) from None


def check_resume_settings(path: Path, settings: dict[str, Any], group_keys: Sequence[str]) -> None:
    """Refuse a resume that changes a key of `fixed_keys(group_keys)`, listing every difference on one line.

    A key the checkpoint saved that is no longer fixed (a group key of another variant's) is not compared.
    Checkpoints written before these settings were saved carry none; they are resumed with a warning.
    """
    saved = read_checkpoint(path).get("grpo_lightning", {}).get("fixed_settings")
    if saved is None:
        log.warning("ckpt_path: %s does not record its run's settings; they cannot be compared", path)
        return
    missing = object()
    fixed = fixed_keys(group_keys)
    still_fixed = {key for key in saved if any(key == f or key.startswith(f"{f}.") for f in fixed)}
    changes = [
        f"{key} {saved.get(key, '<unset>')!r} -> {settings.get(key, '<unset>')!r}"
        for key in sorted(still_fixed | set(settings))
        if saved.get(key, missing) != settings.get(key, missing)
    ]
    if changes:
        raise ValueError(
            f"ckpt_path: {path} cannot be resumed with other values of keys a resume may not change: "
            f"{'; '.join(changes)}. Resume with the original values, or start a new run (hydra.run.dir)"
        )


def check_resumable(path: Path, policy: nn.Module, run_info: dict[str, Any]) -> None:
    """Raise ValueError unless `path` is a readable checkpoint of this model's trainable weights."""
    checkpoint = read_checkpoint(path)
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


# ---- one run per directory ---------------------------------------------------------------------------------------
class RunLock:
    """An exclusive lock on `<output_dir>/.run.lock`, held for the life of the run (rank 0 only).

    Why: two runs writing into one directory overwrite each other's checkpoints, logs and policy while both exit
    0; the "already holds a run" check at start-up cannot see a run that has not written `last.ckpt` yet. The
    lock is `flock`, which the kernel drops when the process dies, so a killed run never leaves a stale lock. The
    file holds the owner's pid, for the error message.
    """

    NAME = ".run.lock"

    def __init__(self, output_dir: str | Path) -> None:
        self._file = None  # release() (and __del__) find no file when the lock was never taken
        import fcntl

        self.path = Path(output_dir) / self.NAME
        self._file = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            owner = self._file.read().strip() or "unknown"
            self._file.close()
            raise ValueError(self.in_use(self.path.parent, owner)) from None
        self._file.truncate(0)
        self._file.write(str(os.getpid()))
        self._file.flush()

    @classmethod
    def holder(cls, output_dir: str | Path) -> str | None:
        """The pid of the run holding `output_dir`'s lock ('unknown' when it wrote none), None when no run does;
        takes nothing and creates no file."""
        import fcntl

        try:
            file = open(Path(output_dir) / cls.NAME)  # noqa: SIM115 - closed below
        except OSError:
            return None
        with file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return file.read().strip() or "unknown"
            return None  # closing the file drops the shared lock

    @staticmethod
    def in_use(output_dir: str | Path, owner: str) -> str:
        return (
            f"paths.output_dir: {Path(output_dir)} is in use by another run (pid {owner}); wait for it to end, "
            "or start this one in another directory (hydra.run.dir)"
        )

    def release(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()  # closing the descriptor releases the flock

    def __del__(self) -> None:
        self.release()
