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
    output_dir: str = setting("", text, "the run's directory: Hydra's run dir (hydra.run.dir) by default")
    cache_dir: str = setting("~/.cache/grpo_lightning", text, "converted models (GGUF -> safetensors), shared")


@dataclass(frozen=True)
class GuardSettings:
    max_consecutive_skipped_steps: int = setting(
        3, integer(1), "this many non-finite steps in a row: save a checkpoint and stop with an error"
    )
    max_norm_growth: float | None = setting(
        2.0, optional(number(above=1)), "one step multiplies the trainable norm by more: diverged, stop (null: off)"
    )


@dataclass(frozen=True)
class LoggingSettings:
    samples_every_n_rounds: int = setting(1, integer(1), "text table of completions and histograms, every N rounds")
    num_samples_logged: int = setting(4, integer(0), "rows in that table")


@dataclass(frozen=True)
class ExportSettings:
    merged: bool = setting(False, boolean, "also write merged full weights to policy/merged/")


@dataclass(frozen=True)
class ModelSettings:
    dtype: str = setting("float32", choice(*DTYPES), "the policy's dtype")
    trust_remote_code: bool = setting(False, boolean, "passed to from_pretrained")
    lora: LoraSettings = setting(factory=LoraSettings, help="LoRA through peft (model.lora.enabled=false: full)")


@dataclass(frozen=True)
class OptimizerKeys:
    """The keys of `optim.optimizer` (torch.optim.AdamW by default) that the application sets or documents."""

    lr: float = setting(5.0e-4, number(low=0), "learning rate; 0 is a control run that never updates")
    weight_decay: float = setting(0.0, number(low=0), "decoupled weight decay")
    betas: tuple[float, float] = setting((0.9, 0.99), betas, "Adam's moment decays")
    eps: float = setting(1e-8, number(above=0), "Adam's epsilon")
    amsgrad: bool = setting(False, boolean, "AMSGrad variant")


@dataclass(frozen=True)
class OptimSettings:
    optimizer: OptimizerKeys = setting(factory=OptimizerKeys, help="a partial optimizer class (_partial_: true)")


@dataclass(frozen=True)
class TrainerKeys:
    """The `lightning.pytorch.Trainer` arguments the application relies on (any other passes through as is)."""

    max_epochs: int = setting(12, integer(1), "rounds: an epoch is one rollout round")
    accumulate_grad_batches: int | None = setting(
        None, optional(integer(1)), "micro-batches per optimizer step; null: the whole round in one step"
    )
    gradient_clip_val: float | None = setting(1.0, optional(number(low=0)), "gradient norm clip")
    log_every_n_steps: int = setting(1, integer(1), "Lightning's logging cadence")
    enable_progress_bar: bool = setting(True, boolean, "the Rich bar with the round's reward")
    enable_model_summary: bool = setting(False, boolean, "Lightning's model summary at the start")
    precision: str = setting("32-true", precision, "32-true on CPU, bf16-mixed on GPU")
    accelerator: str = setting("cpu", choice(*ACCELERATORS), "cpu | gpu | auto")
    devices: int | str | list[int] = setting(1, devices, "a count, -1, auto or a list of device ids")
    num_nodes: int = setting(1, integer(1), "machines (docs/multiprocess.md)")


@dataclass(frozen=True)
class TensorBoardKeys:
    """`logger.tensorboard`: the `lightning.pytorch.loggers.TensorBoardLogger` arguments the application sets."""

    save_dir: str = setting("", text, "the run directory")
    name: str = setting("tensorboard", text, "subdirectory of save_dir")
    version: str | int = setting("", log_version, '"": no version_N subdirectory')
    default_hp_metric: bool = setting(False, boolean, "a placeholder hp_metric scalar")


@dataclass(frozen=True)
class CSVKeys:
    """`logger.csv`: the `lightning.pytorch.loggers.CSVLogger` arguments the application sets (also those of
    `ResumingCSVLogger`, the default target, which keeps a resumed run's rows)."""

    save_dir: str = setting("", text, "the run directory")
    name: str = setting("csv", text, "subdirectory of save_dir")
    version: str | int = setting("", log_version, '"": no version_N subdirectory')


@dataclass(frozen=True)
class WandbKeys:
    """`logger.wandb`: the `lightning.pytorch.loggers.WandbLogger` arguments the application sets."""

    save_dir: str = setting("", text, "the run directory (W&B adds wandb/)")
    offline: bool = setting(True, boolean, "true: no network, `wandb sync` uploads later")
    project: str = setting("grpo_lightning", text, "the W&B project")
    name: str | None = setting(None, optional(text), "the run's display name")
    log_model: bool | str = setting(False, log_model, "upload checkpoints as artifacts (needs offline=false)")


@dataclass(frozen=True)
class MLflowKeys:
    """`logger.mlflow`: the `lightning.pytorch.loggers.MLFlowLogger` arguments the application sets."""

    tracking_uri: str = setting("", text, "where runs are recorded: sqlite:///..., http://host:port, file:<dir>")
    artifact_location: str | None = setting(None, optional(text), "where a new experiment keeps its runs' files")
    experiment_name: str = setting("grpo_lightning", text, "the MLflow experiment")
    run_name: str | None = setting(None, optional(text), "the run's display name")


configures(TensorBoardLogger, TensorBoardKeys)
configures(CSVLogger, CSVKeys)
configures(ResumingCSVLogger, CSVKeys)
configures(WandbLogger, WandbKeys)
configures(MLFlowLogger, MLflowKeys)


@dataclass(frozen=True)
class RunSettings:
    """The top level of the composed config; nodes with a `_target_` are declared by their target's settings."""

    seed: int = setting(0, integer(0, SEED_MAX), "everything random: sampling, prompt order, initialisation")
    dry_run: bool = setting(False, boolean, "validate, load the data, print the plan; load no model")
    ckpt_path: str | None = setting(None, checkpoint_path, "resume: null, last, a run directory or a .ckpt file")
    max_tokens_generated: int | None = setting(
        None, optional(integer(1)), "end at the first round end with this many tokens generated; null: off"
    )
    paths: PathsSettings = setting(factory=PathsSettings, help="where the run writes")
    rollout: RolloutSettings = setting(factory=RolloutSettings, help="generate and train at the same time")
    checkpoint: CheckpointSettings = setting(factory=CheckpointSettings, help="checkpoint cadence")
    guard: GuardSettings = setting(factory=GuardSettings, help="non-finite and divergence guards")
    logging: LoggingSettings = setting(factory=LoggingSettings, help="sample tables and histograms")
    export: ExportSettings = setting(factory=ExportSettings, help="what <output_dir>/policy/ gets")
    model: ModelSettings = setting(factory=ModelSettings, help="the policy: source, dtype, LoRA")
    optim: OptimSettings = setting(factory=OptimSettings, help="optimizer and schedule")
    trainer: TrainerKeys = setting(factory=TrainerKeys, help="Lightning Trainer arguments")
