"""The config check, run before any data or model is loaded: every declared key, then what spans several keys,
files or the platform.

Each key's type and range is declared once, in the settings dataclass of what it configures
(grpo_lightning/schema.py); `check_rules` walks the composed config and checks every declared key
(grpo_lightning/config_keys.py, which also names the keys nothing takes), so a mistake fails in a second with a
message naming the key rather than minutes later, deep inside a constructor, a model load or a training step.
What is left here spans more than one key: combinations (the temperature against half precision, STORPO's step
range, a data path and its test split), the platform (vLLM's build, CUDA, the trainer's devices), files (data
files' encodings, the cache and output directories) and resuming. Each failure is a ValueError whose message
names the config key and what to do (the CLI prints it as one line; several mistakes are joined with "; ").
Values that are legal but probably not meant (a near-zero temperature) get a warning instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.app.launch import check_launch
from grpo_lightning.app.run_settings import RunSettings
from grpo_lightning.config_keys import ABSENT, configured_targets, lookup, node_problems
from grpo_lightning.data.source import DataSource
from grpo_lightning.generation.base import LOW_TEMPERATURE, MIN_TEMPERATURE, Generator
from grpo_lightning.generation.placement import shards_weights, world_size
from grpo_lightning.moved_keys import check_moved_keys
from grpo_lightning.probes.base import ForwardProbe
from grpo_lightning.rewards.base import Stage
from grpo_lightning.rewards.pipeline import TERM_KEYS
from grpo_lightning.schema import made_directory, target_class
from grpo_lightning.training.checkpointing import RunLock
from grpo_lightning.training.overlap import optimizer_steps_per_round, staleness_problem
from grpo_lightning.training.tracking import writer_for

log = logging.getLogger(__name__)


# ---- every declared key ------------------------------------------------------------------------------------------
def check_rules(cfg: DictConfig) -> list[str]:
    """Every declared key of the composed config against its rule (grpo_lightning/schema.py): the top level and
    third-party nodes by `RunSettings` (app/run_settings.py), every node with a `_target_` by its target's settings. A
    key nothing takes is `check_unknown_keys`'s."""
    return node_problems(cfg, "", (RunSettings,))


def check_unknown_keys(cfg: DictConfig) -> None:
    """Every key of the composed config that nothing takes (`config_keys.unknown_keys`), in one ValueError. Run
    after the checks of combinations, whose messages say more when a recipe's keys sit under another option
    (self-play's keys under variant=grpo)."""
    found = node_problems(cfg, "", (RunSettings,), unknown=True, more_keys=reward_term_keys)
    if found:
        raise ValueError("; ".join(found))


def reward_term_keys(path: str) -> frozenset[str]:
    """Keys of a `reward.terms.<name>` node that the reward pipeline takes itself (its weight)."""
    return TERM_KEYS if path.startswith("reward.terms.") and path.count(".") == 2 else frozenset()


def check_components(cfg: DictConfig) -> None:
    """Each configured component's rules across the config (`Configured.check_config`: a variant and its data, an
    engine and the trainer)."""
    for component in configured_targets(cfg):
        component.check_config(cfg)


# ---- the checks --------------------------------------------------------------------------------------------------
def validate(cfg: DictConfig, platform: bool = True) -> None:
    """Check every key's type and range, then the combinations, before anything is loaded (each error names
    its key; all of them are reported at once). `platform=False` leaves out what this machine must have (vLLM, a
    GPU: `check_platform`), for a dry run that prints a GPU recipe's plan on a machine without them first."""
    check_moved_keys(cfg)  # reward.format_bonus, loss.scale_rewards: a one-line message naming the new key
    if "dataset" not in cfg.data:
        raise ValueError(
            "data=rounds is the shape of a round every data source shares (data/rounds.yaml), not a source: choose "
            "data=gsm8k or data=reasoning_gym"
        )
    if "_target_" not in cfg.generator:
        raise ValueError(
            "generator=sampling is the sampling every engine shares (generator/sampling.yaml), not an engine: choose "
            "generator=hf or generator=vllm"
        )
    found = check_rules(cfg)
    if found:
        raise ValueError("; ".join(found))
    check_combinations(cfg)
    check_move_training(cfg)
    check_strategy(cfg)
    check_overlap(cfg)
    check_reward_fits_data(cfg)
    check_components(cfg)
    check_unknown_keys(cfg)
    target = cfg.optim.optimizer.get("_target_")
    if target_class(target) is None:
        raise ValueError(f"optim.optimizer._target_: cannot import {target!r}")
    if platform:
        check_platform(cfg)
        check_launch(cfg)  # what started this process against trainer.devices x trainer.num_nodes (app/launch.py)
    check_logger_packages(cfg)
    check_cache_dir(cfg.paths.cache_dir)
    check_writable(Path(cfg.paths.output_dir))
    check_fresh_or_resume(cfg)


def check_platform(cfg: DictConfig) -> None:
    """What this machine must have for the run: a GPU where the trainer asks for one (what an engine needs is its
    own `check_platform`: generation/vllm/generator.py)."""
    for component in configured_targets(cfg):
        component.check_platform(cfg)
    check_accelerator(cfg)


def check_combinations(cfg: DictConfig) -> None:
    """Values fine one by one that do not go together, or that are legal but probably a mistake (a warning)."""
    temperature = cfg.generator.temperature
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"generator.temperature={temperature!r} is below {MIN_TEMPERATURE}: logits / temperature overflow in "
            "half precision and every group samples one and the same completion (greedy decoding); use a "
            "temperature near 1 for GRPO"
        )
    if temperature < LOW_TEMPERATURE:
        log.warning(
            "generator.temperature=%s is very low: the G samples of a group will be nearly identical, so most "
            "advantages are 0 and rounds train little",
            temperature,
        )


def check_move_training(cfg: DictConfig) -> None:
    """Self-play over the legal moves (`variant.move_policy=legal_moves`) trains on move distributions, not on
    sampled tokens: a probe that reads the training step's token forward would read nothing; refused by name."""
    if OmegaConf.select(cfg, "variant.move_policy", default="text") != "legal_moves":
        return
    for name, node in (cfg.get("probe") or {}).items():
        probe = target_class(node.get("_target_")) if OmegaConf.is_dict(node) else None
        if isinstance(probe, type) and issubclass(probe, ForwardProbe):
            raise ValueError(
                f"probe={name} reads the token forward of each training step, and variant.move_policy=legal_moves "
                f"trains over moves, with no token forward: leave probe={name} out"
            )


def check_logger_packages(cfg: DictConfig) -> None:
    """Each selected tracker's package is installed (its writer in training/tracking.py names it), decided from
    the import system without importing it; a `_target_` that does not import is build()'s to report."""
    for name, node in (cfg.get("logger") or {}).items():
        logger = target_class(node.get("_target_"))
        writer = writer_for(logger) if logger is not None else None
        package = writer.package if writer is not None else None
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"logger.{name} needs the {package} package: pip install 'grpo_lightning[{package}]' (from a "
                f"checkout: pip install -e '.[{package}]'), or leave {name} out of logger=[...]"
            )


def check_reward_fits_data(cfg: DictConfig) -> None:
    """A reward term that scores with the problem's record (`needs_record`, e.g. reward=reasoning_gym) needs a data
    source whose problems carry one (`gives_records`, data=reasoning_gym)."""
    source = target_class(cfg.data.dataset.get("_target_"))
    if source is None or (issubclass(source, DataSource) and source.gives_records):
        return
    for name, spec in (cfg.reward.get("terms") or {}).items():
        term = target_class(spec.get("_target_")) if OmegaConf.is_dict(spec) else None
        if isinstance(term, type) and issubclass(term, Stage) and term.needs_record:
            where = term.record_source
            raise ValueError(
                f"reward.terms.{name} ({term.__name__}) scores with each problem's record from {where}, which "
                f"data.dataset ({source.__name__}) does not give: use {where}, or another reward (reward=gsm8k)"
            )


OTHER_SHARDING = ("fsdp", "FSDPStrategy", "ModelParallelStrategy", "DeepSpeed", "deepspeed")
"""Lightning strategies that shard the model in ways the training forward and the engines do not gather."""


def check_strategy(cfg: DictConfig) -> None:
    """trainer.strategy: a Lightning strategy name (ddp, ...) or trainer=fsdp's; Lightning's other sharding
    strategies (its FSDP1 `FSDPStrategy`, ModelParallelStrategy with a plan of one's own, DeepSpeed) leave the
    training forward, sampling and weight pushes reading shards, so they are refused in one line."""
    strategy = cfg.trainer.get("strategy")
    if shards_weights(cfg.trainer):
        return
    name = strategy.get("_target_", "") if OmegaConf.is_dict(strategy) else str(strategy)
    if any(other.lower() in name.lower() for other in OTHER_SHARDING):
        raise ValueError(
            f"trainer.strategy={name}: this sharding is not supported; use trainer=fsdp (FSDP2 over every process, "
            "docs/scaling.md) or trainer=ddp"
        )


def check_overlap(cfg: DictConfig) -> None:
    """rollout.max_staleness >= 1 (training/overlap.py): a strategy that lets the engine sample beside the trainer,
    and rounds that take no more optimizer steps than the bound, known from data.* and
    trainer.accumulate_grad_batches before anything loads."""
    bound = lookup(cfg, "rollout.max_staleness")
    if bound is ABSENT or not bound:
        return
    key = f"rollout.max_staleness={bound}"  # what each engine needs for it: its own check_config
    engine = target_class(cfg.generator.get("_target_"))
    beside_shards = isinstance(engine, type) and issubclass(engine, Generator) and engine.overlaps_sharded_training
    if shards_weights(cfg.trainer) and not beside_shards:
        raise ValueError(
            f"{key}: trainer=fsdp shards the weights the sampler would copy; use generator=vllm_server (servers hold "
            "weights of their own), trainer=ddp or gpu"
        )
    data, accumulate = cfg.data, cfg.trainer.get("accumulate_grad_batches")
    steps = optimizer_steps_per_round(
        data.prompts_per_round, data.groups_per_micro_batch, data.num_iterations, accumulate, world_size(cfg)
    )
    problem = staleness_problem(steps, bound) if steps is not None else None  # None: another check names it
    if problem is not None:
        raise ValueError(problem)


def check_accelerator(cfg: DictConfig) -> None:
    accelerator = cfg.trainer.get("accelerator")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator}: no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "train on the CPU with trainer=cpu"
        )


def check_cache_dir(value: str) -> None:
    """The converted-model cache: a directory, or one that can be created (it is shared by every run)."""
    made_directory(
        "paths.cache_dir", Path(str(value)).expanduser(), "point paths.cache_dir elsewhere",
        "set paths.cache_dir or the GRPO_LIGHTNING_CACHE environment variable to a writable directory",
    )  # fmt: skip


def check_writable(directory: Path) -> None:
    """Fail before any work when the run could not save its checkpoints and logs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"paths.output_dir: cannot write to {directory} ({err.strerror}); choose another hydra.run.dir"
        ) from None


def check_fresh_or_resume(cfg: DictConfig) -> None:
    """A fresh run never writes into a directory that holds another run's checkpoints, and no run into one that a
    running run holds (its lock: checkpointing.RunLock)."""
    owner = RunLock.holder(cfg.paths.output_dir) if rank_zero_only.rank == 0 else None  # rank 0 holds it for all
    if owner is not None and owner != str(os.getpid()):
        raise ValueError(RunLock.in_use(cfg.paths.output_dir, owner))
    previous = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if cfg.get("ckpt_path") is None and previous.exists():
        raise ValueError(
            f"paths.output_dir {previous.parent.parent} already holds a run ({previous}); resume it with "
            "ckpt_path=last, or start a new run in another directory (hydra.run.dir)"
        )
