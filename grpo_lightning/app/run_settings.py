"""The declarations of the keys no settings dataclass of a component owns: the top level of conf/config.yaml, and
the keys of third-party nodes (Lightning's Trainer and loggers, torch's optimizer) that this application relies on.

Every other node is declared by the class its `_target_` names (grpo_lightning/schema.py): the generator by its
sampling and engine settings, the loss by `GRPOLoss`, and so on. app/validation.py walks the composed config
from `RunSettings` down and checks every declared key before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from lightning.fabric.connector import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from grpo_lightning.models.lora import LoraSettings
from grpo_lightning.models.sources import DTYPES
from grpo_lightning.schema import (
    SEED_MAX,
    boolean,
    choice,
    configures,
    integer,
    is_int,
    is_number,
    number,
    optional,
    setting,
    text,
)
from grpo_lightning.training.checkpointing import CheckpointSettings
from grpo_lightning.training.overlap import RolloutSettings
from grpo_lightning.training.tracking import ResumingCSVLogger

PRECISIONS = {str(p) for p in get_args(_PRECISION_INPUT_STR) + get_args(_PRECISION_INPUT_STR_ALIAS)} | {
    str(p) for p in get_args(_PRECISION_INPUT_INT)
}
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")


def checkpoint_path(value) -> str | None:
    return None if value is None or isinstance(value, str | int) else "must be a path, last or null"


def precision(value) -> str | None:
    return None if str(value) in PRECISIONS else f"must be one of {', '.join(sorted(PRECISIONS))}"


def devices(value) -> str | None:
    if value == "auto" or value == -1 or (is_int(value) and value >= 1):
        return None
    if isinstance(value, list | tuple) and value and all(is_int(v) and v >= 0 for v in value):
        return None
    return "must be a count >= 1, -1, auto, or a list of device ids"


def log_version(value) -> str | None:
    return None if isinstance(value, str) or (is_int(value) and value >= 0) else 'must be "", a name or a number >= 0'


def log_model(value) -> str | None:
    return None if value is True or value is False or value == "all" else "must be true, false or all"


def betas(value) -> str | None:
    ok = isinstance(value, list | tuple) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)
    return None if ok else "must be two numbers in [0, 1), e.g. [0.9, 0.99]"


@dataclass(frozen=True)
class PathsSettings:
    output_dir: str = setting("", text)
    cache_dir: str = setting("~/.cache/grpo_lightning", text)


@dataclass(frozen=True)
class GuardSettings:
    max_consecutive_skipped_steps: int = setting(3, integer(1))
    max_norm_growth: float | None = setting(2.0, optional(number(above=1)))


@dataclass(frozen=True)
class LoggingSettings:
    samples_every_n_rounds: int = setting(1, integer(1))
    num_samples_logged: int = setting(4, integer(0))


@dataclass(frozen=True)
class ExportSettings:
    merged: bool = setting(False, boolean)


@dataclass(frozen=True)
class ModelSettings:
    dtype: str = setting("float32", choice(*DTYPES))
    trust_remote_code: bool = setting(False, boolean)
    lora: LoraSettings = setting(factory=LoraSettings)


@dataclass(frozen=True)
class OptimizerKeys:
    """The keys of `optim.optimizer` (torch.optim.AdamW by default) that the application sets or documents."""

    lr: float = setting(5.0e-4, number(low=0))
    weight_decay: float = setting(0.0, number(low=0))
    betas: tuple[float, float] = setting((0.9, 0.99), betas)
    eps: float = setting(1e-8, number(above=0))
    amsgrad: bool = setting(False, boolean)


@dataclass(frozen=True)
class OptimSettings:
    optimizer: OptimizerKeys = setting(factory=OptimizerKeys)


@dataclass(frozen=True)
class TrainerKeys:
    """The `lightning.pytorch.Trainer` arguments the application relies on (any other passes through as is)."""

    max_epochs: int = setting(12, integer(1))
    accumulate_grad_batches: int | None = setting(None, optional(integer(1)))
    gradient_clip_val: float | None = setting(1.0, optional(number(low=0)))
    log_every_n_steps: int = setting(1, integer(1))
    enable_progress_bar: bool = setting(True, boolean)
    enable_model_summary: bool = setting(False, boolean)
    precision: str = setting("32-true", precision)
    accelerator: str = setting("cpu", choice(*ACCELERATORS))
    devices: int | str | list[int] = setting(1, devices)
    num_nodes: int = setting(1, integer(1))
    collective_timeout_s: float = setting(1800.0, number(above=0))
    """Read by app/launch.py (the strategy's process-group timeout), never passed to the Trainer."""


@dataclass(frozen=True)
class TensorBoardKeys:
    """`logger.tensorboard`: the `lightning.pytorch.loggers.TensorBoardLogger` arguments the application sets."""

    save_dir: str = setting("", text)
    name: str = setting("tensorboard", text)
    version: str | int = setting("", log_version)
    default_hp_metric: bool = setting(False, boolean)


@dataclass(frozen=True)
class CSVKeys:
    """`logger.csv`: the `lightning.pytorch.loggers.CSVLogger` arguments the application sets (also those of
    `ResumingCSVLogger`, the default target, which keeps a resumed run's rows)."""

    save_dir: str = setting("", text)
    name: str = setting("csv", text)
    version: str | int = setting("", log_version)


@dataclass(frozen=True)
class WandbKeys:
    """`logger.wandb`: the `lightning.pytorch.loggers.WandbLogger` arguments the application sets."""

    save_dir: str = setting("", text)
    offline: bool = setting(True, boolean)
    project: str = setting("grpo_lightning", text)
    name: str | None = setting(None, optional(text))
    log_model: bool | str = setting(False, log_model)


@dataclass(frozen=True)
class MLflowKeys:
    """`logger.mlflow`: the `lightning.pytorch.loggers.MLFlowLogger` arguments the application sets."""

    tracking_uri: str = setting("", text)
    artifact_location: str | None = setting(None, optional(text))
    experiment_name: str = setting("grpo_lightning", text)
    run_name: str | None = setting(None, optional(text))


configures(TensorBoardLogger, TensorBoardKeys)
configures(CSVLogger, CSVKeys)
configures(ResumingCSVLogger, CSVKeys)
configures(WandbLogger, WandbKeys)
configures(MLFlowLogger, MLflowKeys)


@dataclass(frozen=True)
class RunSettings:
    """The top level of the composed config; nodes with a `_target_` are declared by their target's settings."""

    seed: int = setting(0, integer(0, SEED_MAX))
    dry_run: bool = setting(False, boolean)
    ckpt_path: str | None = setting(None, checkpoint_path)
    max_tokens_generated: int | None = setting(None, optional(integer(1)))
    paths: PathsSettings = setting(factory=PathsSettings)
    rollout: RolloutSettings = setting(factory=RolloutSettings)
    checkpoint: CheckpointSettings = setting(factory=CheckpointSettings)
    guard: GuardSettings = setting(factory=GuardSettings)
    logging: LoggingSettings = setting(factory=LoggingSettings)
    export: ExportSettings = setting(factory=ExportSettings)
    model: ModelSettings = setting(factory=ModelSettings)
    optim: OptimSettings = setting(factory=OptimSettings)
    trainer: TrainerKeys = setting(factory=TrainerKeys)
