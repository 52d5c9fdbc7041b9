"""train(cfg): build everything from the composed config, fit, return the final metrics.

Pure with respect to the process: no argument parsing, no sys.exit. `__main__` wraps it for the CLI and tests
call it with configs from `hydra.compose`. Config mistakes raise `ValueError` naming the key (the CLI prints
them without a traceback); `instantiate` wraps constructor errors, so `build` unwraps them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.callbacks import SavePolicy
from grpo_lightning.checkpointing import AtomicCheckpointIO, LastCheckpoint, check_resumable, resolve_ckpt_path
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.export import export_policy
from grpo_lightning.generation.callback import RolloutCallback
from grpo_lightning.interrupt import GracefulStop, RunInterrupted
from grpo_lightning.lora_forward import install_fused_lora_forward
from grpo_lightning.models import LoraSettings, resolve_dtype, wrap_policy
from grpo_lightning.module import GRPOModule
from grpo_lightning.quiet import quiet_third_party
from grpo_lightning.rewards import SafeReward
from grpo_lightning.validation import validate, world_size

log = logging.getLogger(__name__)


def build(node: DictConfig, **kwargs):
    """`instantiate`, with every config mistake turned into a ValueError that names the config key.

    A constructor's own ValueError already names its key and passes through; an unknown `_target_`, an unknown
    or wrongly typed argument gets the node's key prefixed.
    """
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            raise cause from None
        key = node._get_full_key(None) or "<config>"
        if isinstance(cause, TypeError):
            raise ValueError(f"{key}: {cause} (check the keys and values under {key})") from None
        if "Error locating target" in str(err):
            raise ValueError(f"{key}._target_: cannot import {node.get('_target_')!r}") from None
        raise


def rank_zero_print(message: str) -> None:
    """Print once per run: a DDP child process (LOCAL_RANK / RANK > 0) stays quiet."""
    if rank_zero_only.rank == 0:
        print(message)


@dataclass(frozen=True)
class Plan:
    """What a run will do; printed by `dry_run=true` and at the start of every run."""

    model: str
    data: str
    num_problems: int
    rounds: int
    prompts_per_round: int
    rollouts_per_round: int
    micro_batches_per_round: int
    accumulate_grad_batches: int
    optimizer_steps_per_round: int
    max_new_tokens: int
    loss: str
    output_dir: str

    def render(self) -> str:
        return "\n".join(f"  {k:<26} {v}" for k, v in self.__dict__.items())


@dataclass
class Run:
    """Everything a run is made of, built and ready to `fit` (tests inspect the parts)."""

    cfg: DictConfig
    plan: Plan
    module: GRPOModule
    datamodule: RolloutDataModule
    trainer: L.Trainer
    ckpt_path: Path | None = None
    """The checkpoint this run resumes from (`ckpt_path` config key), None for a fresh run."""

    def fit(self) -> dict[str, float]:
        """Train; raises TrainingStopped (non-finite guard) or RunInterrupted (signal) after saving."""
        for lg in self.trainer.loggers:
            lg.log_hyperparams(OmegaConf.to_container(self.cfg, resolve=True))
        if self.ckpt_path is not None:
            rank_zero_print(f"resuming from {self.ckpt_path}")
        self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=self.ckpt_path, weights_only=False)
        output_dir = Path(self.cfg.paths.output_dir).resolve()
        rank_zero_print(f"TensorBoard logs: tensorboard --logdir {output_dir}")
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        for callback in self.trainer.callbacks:  # e.g. the evaluator logs outside Lightning's metric store
            metrics.update(getattr(callback, "final_metrics", {}))
        if self.trainer.is_global_zero:
            write_final_metrics(output_dir, metrics)
            saver = next((c for c in self.trainer.callbacks if isinstance(c, SavePolicy)), None)
            if saver is not None:
                export_policy(saver.directory, self.cfg, self.module.policy, saver.tokenizer, metrics, self.plan.model)
        last = output_dir / "checkpoints" / "last.ckpt"
        if self.module.stop_reason is not None:
            raise TrainingStopped(f"training stopped: {self.module.stop_reason}\ncheckpoint: {last}")
        stop = next((c for c in self.trainer.callbacks if isinstance(c, GracefulStop)), None)
        if stop is not None and stop.stopped_after_round is not None:
            raise RunInterrupted(
                stop.signum,
                f"stopped after round {stop.stopped_after_round} (checkpoint saved)\n"
                f"resume: python -m grpo_lightning <same overrides> ckpt_path={last}",
            )
        return metrics


class TrainingStopped(Exception):
    """The run stopped itself (non-finite guard) after saving a checkpoint; the CLI prints it and exits 1."""


def train(cfg: DictConfig) -> dict[str, float]:
    """Run GRPO as configured; returns the last logged value of every metric (dry run: the plan's checks)."""
    if cfg.dry_run:
        return dry_run(cfg)
    return build_run(cfg).fit()


def dry_run(cfg: DictConfig) -> dict[str, float]:
    """Validate the config, load the data, score the reference answers, print the plan; no model load."""
    quiet_third_party()
    L.seed_everything(cfg.seed, workers=True)
    validate(cfg)
    build(cfg.loss)
    reward_fn = build(cfg.reward)
    datamodule, variant, accumulate = _data_and_variant(cfg)
    build(cfg.optim.schedule)
    LoraSettings(**cfg.model.lora)
    build(cfg.eval)
    plan = make_plan(cfg, datamodule, variant, accumulate)
    build_probes(cfg, plan)
    resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)
    print(f"grpo_lightning plan (dry run):\n{plan.render()}")
    return {"dry_run/reference_reward_mean": score_references(datamodule, reward_fn)}


def build_run(cfg: DictConfig) -> Run:
    quiet_third_party()
    L.seed_everything(cfg.seed, workers=True)
    validate(cfg)
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)
    loss = build(cfg.loss)
    reward_fn = SafeReward(build(cfg.reward))
    datamodule, variant, accumulate = _data_and_variant(cfg)
    plan = make_plan(cfg, datamodule, variant, accumulate)
    probes = build_probes(cfg, plan)
    rank_zero_print(f"grpo_lightning plan:\n{plan.render()}")

    source = build(cfg.model.source)
    with torch.random.fork_rng():  # loading (and a first-run GGUF conversion) must not move the seeded RNG
        model, tokenizer = source.load(resolve_dtype(cfg.model.dtype), cfg.model.trust_remote_code)
    lora = LoraSettings(**cfg.model.lora)
    policy, reference = wrap_policy(model, lora, loss.needs_reference)
    if (cfg.get("forward") or {}).get("fused_lora", True):
        install_fused_lora_forward(policy)  # no-op without LoRA layers
    run_info = {"model": plan.model, "lora": repr(lora) if lora.enabled else "full fine-tuning"}
    if ckpt_path is not None:
        check_resumable(ckpt_path, policy, run_info)
    datamodule.tokenizer = tokenizer
    generator = build(cfg.generator, model=policy, tokenizer=tokenizer)
    module = GRPOModule(
        policy=policy,
        reference=reference,
        loss=loss,
        optimizer=build(cfg.optim.optimizer),
        schedule=build(cfg.optim.schedule),
        total_steps=plan.rounds * plan.optimizer_steps_per_round,
        temperature=cfg.generator.temperature,
        max_consecutive_skips=cfg.guard.max_consecutive_skipped_steps,
    )
    module.run_info = run_info
    forward = cfg.get("forward") or {}  # training-forward levers (docs/configuration.md, forward)
    module.share_prefix = bool(forward.get("share_prefix", True))
    module.logits_chunk_tokens = forward.get("logits_chunk_tokens", 128)
    module.runs_by_length = bool(forward.get("runs_by_length", True))
    trainer = build_trainer(cfg, accumulate, generator, variant, reward_fn, datamodule, tokenizer, probes)
    return Run(cfg=cfg, plan=plan, module=module, datamodule=datamodule, trainer=trainer, ckpt_path=ckpt_path)


def _data_and_variant(cfg: DictConfig):
    variant = build(cfg.variant)
    datamodule: RolloutDataModule = build(cfg.data)
    datamodule.set_world_size(world_size(cfg))
    datamodule.setup("fit")
    return datamodule, variant, accumulate_grad_batches(cfg, datamodule)


def build_probes(cfg: DictConfig, plan: Plan) -> list[L.Callback]:
    """The `probe` multi-select group's callbacks, each checked against the run's shape."""
    probes = [build(node) for node in (cfg.get("probe") or {}).values()]
    micro_batches_per_step = plan.accumulate_grad_batches
    for probe in probes:
        check = getattr(probe, "check_setup", None)
        if check is not None:
            check(micro_batches_per_step, world_size(cfg))
    return probes


def build_trainer(cfg, accumulate, generator, variant, reward_fn, datamodule, tokenizer, probes=()) -> L.Trainer:
    output_dir = Path(cfg.paths.output_dir)
    callbacks = [
        GracefulStop(),  # first: its round-end hook must run before the rollout callback's
        RolloutCallback(
            generator,
            variant,
            reward_fn,
            datamodule,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            samples_every_n_rounds=cfg.logging.samples_every_n_rounds,
            num_samples_logged=cfg.logging.num_samples_logged,
            seed=cfg.seed,
        ),
        ModelCheckpoint(
            dirpath=output_dir / "checkpoints",
            filename="round{epoch:03d}",
            every_n_epochs=cfg.checkpoint.every_n_rounds,
            save_top_k=-1,
            save_last=False,
        ),
        LastCheckpoint(output_dir / "checkpoints"),
        SavePolicy(output_dir / "policy", tokenizer),
    ]
    callbacks.extend(getattr(generator, "callbacks", []))  # stale-weight guard; vLLM sleep and final push
    if cfg.eval.enabled:
        callbacks.append(build(cfg.eval).bind(generator, tokenizer))
    callbacks.extend(probes)
    callbacks.extend(build(node) for node in (cfg.get("callbacks") or {}).values())  # the user's own
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar())
    logger = build(cfg.logger)
    return build(
        cfg.trainer,
        callbacks=callbacks,
        logger=logger,
        accumulate_grad_batches=accumulate,
        plugins=[AtomicCheckpointIO()],
    )


def write_final_metrics(output_dir: Path, metrics: dict[str, float]) -> None:
    """`final_metrics.json` in the run dir: what a sweep summary reads (written atomically)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / "final_metrics.json.tmp"
    tmp.write_text(json.dumps(dict(sorted(metrics.items())), indent=1))
    os.replace(tmp, output_dir / "final_metrics.json")


def accumulate_grad_batches(cfg: DictConfig, dm: RolloutDataModule) -> int:
    """Micro-batches per optimizer step: by default the whole round in one step (old_logp = logp.detach())."""
    per_round = dm.micro_batches_per_round * dm.num_iterations
    value = cfg.trainer.get("accumulate_grad_batches") or dm.micro_batches_per_round
    if value < 1 or per_round % value:
        raise ValueError(
            f"trainer.accumulate_grad_batches must divide the {per_round} micro-batches of a round "
            f"(data.prompts_per_round / data.groups_per_micro_batch x data.num_iterations) (got {value})"
        )
    return int(value)


def make_plan(cfg: DictConfig, dm: RolloutDataModule, variant, accumulate: int) -> Plan:
    rounds = cfg.trainer.max_epochs
    if rounds is None or rounds < 1:
        raise ValueError(f"trainer.max_epochs (number of rollout rounds) must be >= 1 (got {rounds})")
    if dm.prompts_per_round > len(dm.problems):
        raise ValueError(
            f"data.prompts_per_round ({dm.prompts_per_round}) exceeds the {len(dm.problems)} problems loaded"
        )
    per_round = dm.micro_batches_per_round * dm.num_iterations
    return Plan(
        model=build(cfg.model.source).describe(),
        data=dm.dataset.describe(),
        num_problems=len(dm.problems),
        rounds=rounds,
        prompts_per_round=dm.prompts_per_round,
        rollouts_per_round=variant.rollouts_per_round(dm.prompts_per_round),
        micro_batches_per_round=per_round,
        accumulate_grad_batches=accumulate,
        optimizer_steps_per_round=per_round // accumulate,
        max_new_tokens=cfg.generator.max_new_tokens,
        loss=f"{cfg.loss.loss_type} (beta={cfg.loss.beta}, scale_rewards={cfg.loss.scale_rewards})",
        output_dir=str(Path(cfg.paths.output_dir).resolve()),
    )


def score_references(dm: RolloutDataModule, reward_fn) -> float:
    """Mean reward of the reference solutions against their own answers: 1.0 when data and reward agree."""
    scores = [reward_fn(p.solution, p.answer) for p in dm.problems]
    mean = sum(scores) / len(scores)
    print(f"reference solutions score {mean:.4f} on {len(scores)} problems")
    if mean < 1.0:
        log.warning("%d reference solutions do not score 1.0", sum(s < 1.0 for s in scores))
    return mean
