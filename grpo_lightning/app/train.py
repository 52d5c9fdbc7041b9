"""train(cfg): build everything from the composed config, fit, return the final metrics.

Pure with respect to the process: no argument parsing, no sys.exit. `__main__` wraps it for the CLI and tests
call it with configs from `hydra.compose`. Config mistakes raise `ValueError` naming the key (the CLI prints
them without a traceback); `instantiate` wraps constructor errors, so `build` unwraps them.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from grpo_lightning import openmp
from grpo_lightning.accel.activation_checkpointing import enable_activation_checkpointing
from grpo_lightning.accel.fused_lora import install_fused_lora_forward
from grpo_lightning.app.build import build, first_line
from grpo_lightning.app.export import export_policy
from grpo_lightning.app.plan import Plan, accumulate_grad_batches, check_model_fits, make_plan, score_references
from grpo_lightning.app.quiet import quiet_third_party
from grpo_lightning.app.summary import render as render_summary
from grpo_lightning.app.summary import summary_metrics
from grpo_lightning.app.validation import check_fresh_or_resume, check_platform, validate
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.distributed import lost_a_process
from grpo_lightning.errors import RunInterrupted, TrainingStopped
from grpo_lightning.generation.placement import trainer_devices, world_size
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from grpo_lightning.models.sources import resolve_dtype
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.schema import import_target
from grpo_lightning.training import tracking
from grpo_lightning.training.callbacks import SavePolicy
from grpo_lightning.training.checkpointing import (
    AtomicCheckpointIO,
    RunLock,
    check_resumable,
    check_resume_settings,
    fixed_settings,
    read_checkpoint,
    resolve_ckpt_path,
)
from grpo_lightning.training.evaluation import Evaluator
from grpo_lightning.training.module import GRPOModule
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.variants import VARIANTS
from grpo_lightning.variants.base import GRPOVariant

log = logging.getLogger(__name__)


def rank_zero_print(message: str) -> None:
    """Print once per run: a DDP child process (LOCAL_RANK / RANK > 0) stays quiet."""
    if rank_zero_only.rank == 0:
        print(message)


@dataclass
class Run:
    """Everything a run is made of, built and ready to `fit` (tests inspect the parts)."""

    cfg: DictConfig
    plan: Plan
    module: GRPOModule
    datamodule: RolloutDataModule
    trainer: L.Trainer
    source: object
    """The `model.source` the policy was loaded from (the exported model card names it)."""
    callbacks: dict[str, L.Callback]
    """The `callbacks` group's callbacks by name (conf/callbacks/default.yaml); the trainer runs these and the
    engine's, the evaluator and the probes."""
    evaluator: Evaluator | None = None
    """The `eval` node's evaluator, None with eval.enabled=false (the rollout loop runs it)."""
    ckpt_path: Path | None = None
    """The checkpoint this run resumes from (`ckpt_path` config key), None for a fresh run."""
    lock: RunLock | None = None
    """This run's hold on its output directory (rank 0), released when `fit` returns or raises."""

    def fit(self) -> dict[str, float]:
        """Train; raises TrainingStopped (non-finite or divergence guard) or RunInterrupted (signal)."""
        try:
            return self._fit()
        finally:
            tracking.close(self.trainer.loggers)  # e.g. the W&B run, which would outlive this one in the process
            self.rollout_loop.generator.close()  # e.g. vLLM servers the run started (a sweep's next job starts its own)
            if self.lock is not None:
                self.lock.release()

    def _fit(self) -> dict[str, float]:
        tracking.log_hparams(self.trainer.loggers, OmegaConf.to_container(self.cfg, resolve=True))
        if self.ckpt_path is not None:
            rank_zero_print(f"resuming from {self.ckpt_path}")
        output_dir = Path(self.cfg.paths.output_dir).resolve()
        last = output_dir / "checkpoints" / "last.ckpt"
        try:
            self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=self.ckpt_path, weights_only=False)
        except RuntimeError as err:
            if self.trainer.world_size == 1 or not lost_a_process(err):
                raise
            reason = str(err).strip().splitlines()[0][:200]
            resume = last if last.is_file() else "<none yet: start again>"
            raise TrainingStopped(
                f"training stopped: another training process is gone ({reason})\n"
                f"resume: python -m grpo_lightning <same overrides> ckpt_path={resume}"
            ) from None
        if self.ckpt_path is not None and self.rollout_loop.rounds_trained == 0:
            self.finish_a_finished_run()
        if self.trainer.is_global_zero:  # where each tracker keeps the run, and how to open it
            for line in tracking.describe(self.trainer.loggers):
                print(line)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        if self.evaluator is not None:  # it logs to the loggers directly, outside Lightning's metric store
            metrics.update(self.evaluator.final_metrics)
        summary, text = closing_summary(self.rollout_loop, self.evaluator)
        metrics.update(summary)
        rank_zero_print(text)
        if self.trainer.is_global_zero:
            write_final_metrics(output_dir, metrics)
            saver = self.callbacks.get("save_policy")
            if isinstance(saver, SavePolicy):
                export_policy(saver.directory, self.cfg, self.module.policy, saver.tokenizer, metrics, self.source,
                              self.rollout_loop.variant)  # fmt: skip
        if self.module.diverged:
            raise TrainingStopped(f"training stopped: {self.module.stop_reason}\n{self.checkpoint_before_divergence()}")
        if self.module.stop_reason is not None:
            raise TrainingStopped(f"training stopped: {self.module.stop_reason}\ncheckpoint: {last}")
        stop = self.callbacks["stop"]
        if stop.stopped_after_round is not None:
            raise RunInterrupted(
                stop.signum,
                f"stopped after round {stop.stopped_after_round} (checkpoint saved)\n"
                f"resume: python -m grpo_lightning <same overrides> ckpt_path={last}",
            )
        return metrics

    def finish_a_finished_run(self) -> None:
        """A resumed checkpoint with no round left (a finished run, or one stopped after its last checkpoint):
        Lightning runs no round and no end-of-training hook, so what follows the last round is done here, the same
        way again: the policy saved from the restored weights, and the final metrics from the evaluation the
        checkpoint holds (the last round's evaluation runs before its checkpoint is written)."""
        saver = self.callbacks.get("save_policy")
        if isinstance(saver, SavePolicy):
            saver.on_train_end(self.trainer, self.module)
        if self.evaluator is not None and self.evaluator.history and not self.evaluator.final_metrics:
            self.evaluator.final_metrics = dict(self.evaluator.history[-1][1])
        rank_zero_print("the checkpoint had no round left: the policy and final metrics are written from it")

    @property
    def rollout_loop(self) -> RolloutLoop:
        """The round's owner (`callbacks.rollout_loop`): its `history` holds every round's metrics."""
        return self.callbacks["rollout_loop"]

    def checkpoint_before_divergence(self) -> str:
        """Where the newest checkpoint from before the divergence is, and how to resume from it."""
        last = Path(self.cfg.paths.output_dir).resolve() / "checkpoints" / "last.ckpt"
        candidate = last if last.is_file() else self.ckpt_path
        if candidate is None:
            return "nothing was saved: the run diverged in its first round; start again with a lower optim.optimizer.lr"
        round_index = read_checkpoint(candidate).get("epoch")
        return (
            f"checkpoint: {candidate} (round {round_index}, from before the divergence; the diverged round was not "
            "saved). Resume: python -m grpo_lightning <same overrides> optim.optimizer.lr=<lower> "
            f"ckpt_path={candidate}"
        )


def closing_summary(rollout_loop: RolloutLoop, evaluator: Evaluator | None) -> tuple[dict[str, float], str]:
    """The run's `summary/*` metrics and their rendering (app/summary.py), from every round and evaluation so far."""
    rounds, evals = rollout_loop.history, evaluator.history if evaluator is not None else []
    summary = summary_metrics(rounds, evals)
    return summary, render_summary(summary, len(rounds), len(evals))


def train(cfg: DictConfig) -> dict[str, float]:
    """Run GRPO as configured; returns the last logged value of every metric (dry run: the plan's checks)."""
    if cfg.dry_run:
        return dry_run(cfg)
    if openmp.CHOICE is not None:
        log.info("%s", openmp.CHOICE)
    return build_run(cfg).fit()


def dry_run(cfg: DictConfig) -> dict[str, float]:
    """Validate the config, load the data, score the reference answers, print the plan; no model load.

    What this machine lacks (vLLM, a GPU) is reported after the plan: a GPU recipe's plan and memory estimate are
    worth reading on a login node before the job is submitted."""
    quiet_third_party()
    validate(cfg, platform=False)  # first: seed_everything replaces a bad seed with a random one and only warns
    L.seed_everything(cfg.seed, workers=True)
    source = build(cfg.model.source)  # its own checks (a local folder's config.json and weights)
    build(cfg.loss)
    reward_fn = build_pipeline(cfg)
    variant = build(cfg.variant)
    datamodule, accumulate = build_data(cfg)
    check_reward_fits_variant(reward_fn, variant)
    build(cfg.optim.schedule)
    LoraSettings(**cfg.model.lora)
    build(cfg.eval)
    build(cfg.perf.forward)  # the speed levers' settings (docs/performance.md)
    build(cfg.perf.generate)
    callback_parameters(cfg.callbacks)
    plan = make_plan(cfg, source, datamodule, variant, accumulate, reward_fn)
    plan.check_fits()
    build_probes(cfg, plan)
    resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)
    print(f"grpo_lightning plan (dry run):\n{plan.render()}")
    print(f"variants: {', '.join(sorted(VARIANTS))} (this run: {variant.name}; choose with variant=<name>)")
    check_platform(cfg)  # after the plan: vLLM or a GPU this machine lacks ends the dry run here
    if not datamodule.dataset.has_solutions:  # games: nothing to score before playing
        return {}
    return {"dry_run/reference_reward_mean": score_references(datamodule, reward_fn)}


def build_run(cfg: DictConfig) -> Run:
    quiet_third_party()
    validate(cfg)  # first: seed_everything replaces a bad seed with a random one and only warns
    L.seed_everything(cfg.seed, workers=True)
    source = build(cfg.model.source)
    variant = build(cfg.variant)
    group_keys = variant.group().keys
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), cfg.paths.output_dir)
    settings = fixed_settings(cfg, group_keys)
    if ckpt_path is not None:
        check_resume_settings(ckpt_path, settings, group_keys)
    source.check_available()  # e.g. a Hub model offline and not in the cache
    lock = RunLock(cfg.paths.output_dir) if rank_zero_only.rank == 0 else None
    try:
        check_fresh_or_resume(cfg)  # again, now that no other run can start here
        return _build_run(cfg, source, variant, ckpt_path, settings, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _build_run(
    cfg: DictConfig, source, variant: GRPOVariant, ckpt_path: Path | None, settings: dict, lock: RunLock | None
) -> Run:
    loss = build(cfg.loss)
    reward_fn = build_pipeline(cfg)  # a term that raises scores 0, counted in rollout/reward_errors
    datamodule, accumulate = build_data(cfg)
    check_reward_fits_variant(reward_fn, variant)
    plan = make_plan(cfg, source, datamodule, variant, accumulate, reward_fn)
    rank_zero_print(f"grpo_lightning plan:\n{plan.render()}")
    plan.check_fits()  # before the model loads: a run that cannot fit is refused in one line
    probes = build_probes(cfg, plan)
    loggers = build_loggers(cfg)  # before the model loads: a tracker's setting that its constructor refuses fails now

    with torch.random.fork_rng():  # loading (and a first-run GGUF conversion) must not move the seeded RNG
        model, tokenizer = load_model(source, cfg)
    check_model_fits(cfg, model, tokenizer, datamodule)
    lora = LoraSettings(**cfg.model.lora)
    policy, reference = wrap_policy(model, lora, loss.needs_reference)
    forward_settings = build(cfg.perf.forward)  # training-forward levers (docs/performance.md)
    if forward_settings.fused_lora:
        install_fused_lora_forward(policy)  # no-op without LoRA layers
    if forward_settings.activation_checkpointing:
        enable_activation_checkpointing(policy)
    run_info = {"model": plan.model, "lora": repr(lora) if lora.enabled else "full fine-tuning"}
    if ckpt_path is not None:
        check_resumable(ckpt_path, policy, run_info)
    rows = {"batch_size": plan.decode_rows_per_call} if cfg.generator.get("batch_size") == "auto" else {}
    generator = build(
        cfg.generator,
        model=policy,
        tokenizer=tokenizer,
        generation_settings=build(cfg.perf.generate),
        trainer_devices=trainer_devices(cfg),
        **rows,  # generator.batch_size=auto: the plan's rows (fitted to the GPU's memory)
    )
    module: GRPOModule = build(cfg.module, _partial_=True)(  # the `module` node with what the run built
        policy=policy,
        reference=reference,
        loss=loss,
        optimizer=build(cfg.optim.optimizer),
        schedule=build(cfg.optim.schedule),
        total_steps=plan.rounds * plan.optimizer_steps_per_round,
        run_info=run_info,
        fixed_settings=settings,
        forward_settings=forward_settings,
    )
    variant.bind_data(datamodule.dataset, tokenizer, datamodule.settings.max_prompt_tokens)
    evaluator = build(cfg.eval, generator=generator, tokenizer=tokenizer) if cfg.eval.enabled else None
    run_objects = {"generator": generator, "variant": variant, "reward_fn": reward_fn, "datamodule": datamodule,
                   "tokenizer": tokenizer, "evaluator": evaluator}  # fmt: skip
    callbacks = build_callbacks(cfg.callbacks, run_objects)
    summary = tracking.SummaryToLoggers(functools.partial(closing_summary, callbacks["rollout_loop"], evaluator))
    extra = [*generator.callbacks, *([evaluator] if evaluator is not None else []), *probes, summary]
    trainer = build_trainer(cfg, accumulate, [*callbacks.values(), *extra], loggers)
    return Run(
        cfg=cfg,
        plan=plan,
        module=module,
        datamodule=datamodule,
        trainer=trainer,
        source=source,
        callbacks=callbacks,
        evaluator=evaluator,
        ckpt_path=ckpt_path,
        lock=lock,
    )


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


def build_callbacks(node: DictConfig, run_objects: dict) -> dict[str, L.Callback]:
    """The `callbacks` group's entries, in order, by name.

    Each entry's `_target_` gets the config's arguments plus those of its parameters that name one of the run's
    objects (`run_objects`, then the callbacks built before it, by their names): the rollout loop takes the
    generator, the variant, ...; `SavePolicy` the tokenizer; a user's callback can ask for any of them the same
    way. An entry whose target returns None (the progress bar when it is off) adds nothing.
    """
    built: dict[str, L.Callback] = {}
    for name, parameters in callback_parameters(node).items():
        available = run_objects | built
        passed = {k: available[k] for k in parameters if k in available and k not in node[name]}
        callback = build(node[name], _partial_=True)(**passed)  # run objects passed as they are, not as config
        if callback is not None:
            built[name] = callback
    return built


def build_trainer(cfg: DictConfig, accumulate: int, callbacks: list[L.Callback], loggers: list) -> L.Trainer:
    """The `trainer` node with the run's callbacks, the `logger` group's loggers and the atomic checkpoint writer."""
    return build(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers or False,
        accumulate_grad_batches=accumulate,
        plugins=[AtomicCheckpointIO()],
    )


def build_loggers(cfg: DictConfig) -> list:
    """The `logger` multi-select group's loggers, in the order selected (`logger=[tensorboard,wandb]`); none with
    `logger=[]`. Lightning writes scalars to each; training/tracking.py fans tables, histograms and the summary out."""
    return [build(node) for node in (cfg.get("logger") or {}).values()]


def write_final_metrics(output_dir: Path, metrics: dict[str, float]) -> None:
    """`final_metrics.json` in the run dir: what a sweep summary reads (written atomically)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / "final_metrics.json.tmp"
    tmp.write_text(json.dumps(dict(sorted(metrics.items())), indent=1))
    os.replace(tmp, output_dir / "final_metrics.json")
