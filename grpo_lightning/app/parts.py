"""The run's parts, each built from its config node: the policy, the data, the reward, the probes, the loggers,
the callbacks and the trainer (app/train.py assembles them into a `Run`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.accel.activation_checkpointing import enable_activation_checkpointing
from grpo_lightning.accel.fused_lora import install_fused_lora_forward
from grpo_lightning.accel.settings import ForwardSettings
from grpo_lightning.app.build import build, first_line
from grpo_lightning.app.launch import bounded_strategy, trainer_node
from grpo_lightning.app.plan import Plan, accumulate_grad_batches, check_model_fits
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.generation.placement import world_size
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from grpo_lightning.models.sources import resolve_dtype
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.schema import import_target
from grpo_lightning.training.checkpointing import AtomicCheckpointIO, check_resumable


def build_policy(
    cfg: DictConfig, source, datamodule, loss, plan: Plan, ckpt_path: Path | None, forward_settings: ForwardSettings
):
    """The model loaded and wrapped for training (LoRA or full, its frozen reference when the loss needs one),
    the training forward's levers (`perf.forward`, the module's own settings) installed; with `ckpt_path`,
    checked against the checkpoint's model. Returns (policy, reference, tokenizer, run_info)."""
    with torch.random.fork_rng():  # loading (and a first-run GGUF conversion) must not move the seeded RNG
        model, tokenizer = load_model(source, cfg)
    check_model_fits(cfg, model, tokenizer, datamodule)
    lora = LoraSettings(**cfg.model.lora)
    policy, reference = wrap_policy(model, lora, loss.needs_reference)
    if forward_settings.fused_lora:
        install_fused_lora_forward(policy)  # no-op without LoRA layers
    if forward_settings.activation_checkpointing:
        enable_activation_checkpointing(policy)
    run_info = {"model": plan.model, "lora": repr(lora) if lora.enabled else "full fine-tuning"}
    if ckpt_path is not None:
        check_resumable(ckpt_path, policy, run_info)
    return policy, reference, tokenizer, run_info


def load_model(source, cfg: DictConfig):
    """`source.load`, with a failure turned into one line naming `model.source` (a folder without weights, a
    broken config.json, a download that failed)."""
    try:
        return source.load(resolve_dtype(cfg.model.dtype), cfg.model.trust_remote_code)
    except ValueError as err:
        if str(err).startswith(("model.", "paths.")):  # ours: already names its key
            raise
        raise ValueError(f"model.source: cannot load {source.describe()}: {first_line(err)}") from None
    except (OSError, KeyError, TypeError, RuntimeError) as err:
        raise ValueError(
            f"model.source: cannot load {source.describe()} ({type(err).__name__}: {first_line(err)})"
        ) from None


def build_pipeline(cfg: DictConfig):
    """The `reward` config group's pipeline (docs/rewards.md), told the loss type and the completion budget."""
    return build_reward(cfg.reward, loss_type=cfg.loss.get("loss_type"), max_new_tokens=cfg.generator.max_new_tokens)


def check_reward_fits_variant(reward_fn, variant) -> None:
    if reward_fn.uses_steps and not variant.knows_steps:
        raise ValueError(
            f"reward.step_transforms need a variant that knows reasoning steps (variant=storpo); "
            f"variant {variant.name!r} does not (remove them or choose variant=storpo)"
        )


def build_data(cfg: DictConfig) -> tuple[RolloutDataModule, int]:
    """The data module with its problems loaded, and the micro-batches per optimizer step."""
    datamodule: RolloutDataModule = build(cfg.data, world_size=world_size(cfg))
    datamodule.setup("fit")  # the problems, for the plan's checks (Lightning's own call finds them loaded)
    return datamodule, accumulate_grad_batches(cfg, datamodule)


def build_probes(cfg: DictConfig, plan: Plan) -> list[L.Callback]:
    """The `probe` multi-select group's callbacks, each checked against the run's shape."""
    probes = [build(node) for node in (cfg.get("probe") or {}).values()]
    micro_batches_per_step = plan.accumulate_grad_batches
    for probe in probes:
        probe.check_setup(micro_batches_per_step, world_size(cfg))
    return probes


REQUIRED_CALLBACKS = ("stop", "rollout_loop", "last_checkpoint")
"""Callbacks a run cannot do without: the graceful stop, the round's owner, the checkpoint a resume reads."""


def callback_parameters(node: DictConfig) -> dict[str, list[str]]:
    """Each `callbacks` entry's constructor parameters, after checking the entries a run needs are there and
    every `_target_` imports (a dry run stops here: the callbacks themselves need the run's objects)."""
    missing = [name for name in REQUIRED_CALLBACKS if name not in node]
    if missing:
        raise ValueError(
            f"callbacks.{missing[0]} is required (the run's {', '.join(REQUIRED_CALLBACKS)}); remove other "
            "callbacks, not this one"
        )
    parameters = {}
    for name, spec in node.items():
        target = spec.get("_target_") if OmegaConf.is_dict(spec) else None
        if target is None:
            raise ValueError(f"callbacks.{name}._target_ is missing: give the callback's class")
        found = import_target(target)
        if found is None:
            raise ValueError(f"callbacks.{name}._target_: cannot import {target!r}")
        parameters[name] = list(inspect.signature(found).parameters)
    return parameters


def build_callbacks(
    node: DictConfig, run_objects: dict, built_by_the_run: dict[str, L.Callback]
) -> dict[str, L.Callback]:
    """The `callbacks` group's entries, in order, by name.

    The entries the run builds itself with its objects (`built_by_the_run`: the graceful stop, and the rollout
    loop, which is handed the generator, variant, reward, data module, tokenizer and evaluator explicitly) take
    their place in the order. Every other entry's `_target_` gets the config's arguments plus those of its
    parameters that name one of the run's objects (`run_objects`, then the callbacks before it, by their names):
    `SavePolicy` the tokenizer, the live view the variant; a user's callback can ask for any of them the same
    way. An entry whose target returns None (the progress bar when it is off) adds nothing.
    """
    built: dict[str, L.Callback] = {}
    for name, parameters in callback_parameters(node).items():
        if name in built_by_the_run:
            built[name] = built_by_the_run[name]
            continue
        available = run_objects | built
        passed = {k: available[k] for k in parameters if k in available and k not in node[name]}
        callback = build(node[name], _partial_=True)(**passed)  # run objects passed as they are, not as config
        if callback is not None:
            built[name] = callback
    return built


def build_trainer(cfg: DictConfig, accumulate: int, callbacks: list[L.Callback], loggers: list) -> L.Trainer:
    """The `trainer` node with the run's callbacks, the `logger` group's loggers and the atomic checkpoint writer;
    its strategy waits at most `trainer.collective_timeout_s` at a collective (app/launch.py)."""
    strategy = bounded_strategy(cfg)
    return build(
        trainer_node(cfg),
        callbacks=callbacks,
        logger=loggers or False,
        accumulate_grad_batches=accumulate,
        plugins=[AtomicCheckpointIO()],
        **({} if strategy is None else {"strategy": strategy}),
    )


def build_loggers(cfg: DictConfig) -> list:
    """The `logger` multi-select group's loggers, in the order selected (`logger=[tensorboard,wandb]`); none with
    `logger=[]`. Lightning writes scalars to each; training/tracking.py fans tables, histograms and the summary out."""
    return [build(node) for node in (cfg.get("logger") or {}).values()]
