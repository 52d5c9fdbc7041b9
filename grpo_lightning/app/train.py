"""train(cfg): build everything from the composed config, fit, return the final metrics.

Pure with respect to the process: no argument parsing, no sys.exit. `__main__` wraps it for the CLI and tests
call it with configs from `hydra.compose`. Config mistakes raise `ValueError` naming the key (the CLI prints
them without a traceback); `instantiate` wraps constructor errors, so `build` unwraps them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from grpo_lightning import openmp
from grpo_lightning.app.build import build
from grpo_lightning.app.export import export_policy
from grpo_lightning.app.launch import collective_timed_out_stop, end_started_processes
from grpo_lightning.app.parts import (
    build_callbacks,
    build_data,
    build_loggers,
    build_pipeline,
    build_policy,
    build_probes,
    build_trainer,
    callback_parameters,
    check_reward_fits_variant,
)
from grpo_lightning.app.plan import Plan, make_plan, score_references
from grpo_lightning.app.quiet import quiet_third_party
from grpo_lightning.app.run_record import without_secrets, write_run_record
from grpo_lightning.app.summary import render as render_summary
from grpo_lightning.app.summary import summary_metrics
from grpo_lightning.app.validation import check_fresh_or_resume, check_platform, validate
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.distributed import collective_timed_out, lost_a_process
from grpo_lightning.errors import EngineFailed, RunInterrupted, TrainingStopped
from grpo_lightning.generation.placement import trainer_devices
from grpo_lightning.models.lora import LoraSettings
from grpo_lightning.training import tracking
from grpo_lightning.training.callbacks import SavePolicy
from grpo_lightning.training.checkpointing import (
    RunLock,
    check_resume_settings,
    fixed_settings,
    read_checkpoint,
    resolve_ckpt_path,
)
from grpo_lightning.training.evaluation import Evaluator
from grpo_lightning.training.interrupt import GracefulStop
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
        tracking.log_hparams(self.trainer.loggers, without_secrets(OmegaConf.to_container(self.cfg, resolve=True)))
        if self.ckpt_path is not None:
            rank_zero_print(f"resuming from {self.ckpt_path}")
        output_dir = Path(self.cfg.paths.output_dir).resolve()
        last = output_dir / "checkpoints" / "last.ckpt"
        try:
            self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=self.ckpt_path, weights_only=False)
        except EngineFailed as err:
            if not err.resumable:
                raise
            resume = last if last.is_file() else "<none yet: start again>"
            raise EngineFailed(f"{err}\nresume: python -m grpo_lightning <same overrides> ckpt_path={resume}") from None
        except RuntimeError as err:
            if collective_timed_out(err):  # trainer.collective_timeout_s passed (app/launch.py)
                end_started_processes(self.trainer)
                raise collective_timed_out_stop(err, self.cfg, last) from None
            if self.trainer.world_size == 1 or not lost_a_process(err):
                raise
            reason = str(err).strip().splitlines()[0][:200]
            resume = last if last.is_file() else "<none yet: start again>"
            stop = TrainingStopped(
                f"training stopped: another training process is gone ({reason})\n"
                f"resume: python -m grpo_lightning <same overrides> ckpt_path={resume}"
            )
            # printed now, before the clean-up (stopping the run's servers takes seconds): Lightning's launcher
            # SIGKILLs the first process within 5 s of seeing another one die, and the line must be out by then
            print(f"error: {stop}", file=sys.stderr, flush=True)
            stop.printed = True
            raise stop from None
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
                              self.rollout_loop.sampler.variant, self.datamodule.dataset)  # fmt: skip
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
        if lock is not None:
            write_run_record(cfg)  # accepted: Hydra's record and the log file (app/run_record.py)
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

    forward_settings = build(cfg.perf.forward)  # training-forward levers (docs/performance.md)
    parts = build_policy(cfg, source, datamodule, loss, plan, ckpt_path, forward_settings)
    policy, reference, tokenizer, run_info = parts
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
    variant.bind_module(module)
    evaluator = build(cfg.eval, generator=generator, tokenizer=tokenizer) if cfg.eval.enabled else None
    stop: GracefulStop = build(cfg.callbacks.stop)
    rollout_loop: RolloutLoop = build(cfg.callbacks.rollout_loop, _partial_=True)(
        generator=generator, variant=variant, reward_fn=reward_fn, datamodule=datamodule, tokenizer=tokenizer,
        stop=stop, evaluator=evaluator,
    )  # fmt: skip
    run_objects = {"generator": generator, "variant": variant, "reward_fn": reward_fn, "datamodule": datamodule,
                   "tokenizer": tokenizer, "evaluator": evaluator}  # fmt: skip
    callbacks = build_callbacks(cfg.callbacks, run_objects, {"stop": stop, "rollout_loop": rollout_loop})
    summary = tracking.SummaryToLoggers(functools.partial(closing_summary, rollout_loop, evaluator))
    extra = [*generator.callbacks, *([evaluator] if evaluator is not None else []), *probes, summary]
    trainer = build_trainer(cfg, accumulate, [*callbacks.values(), *extra], loggers)
    return Run(cfg=cfg, plan=plan, module=module, datamodule=datamodule, trainer=trainer, source=source,
               callbacks=callbacks, evaluator=evaluator, ckpt_path=ckpt_path, lock=lock)  # fmt: skip


def write_final_metrics(output_dir: Path, metrics: dict[str, float]) -> None:
    """`final_metrics.json` in the run dir: what a sweep summary reads (written atomically)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / "final_metrics.json.tmp"
    tmp.write_text(json.dumps(dict(sorted(metrics.items())), indent=1))
    os.replace(tmp, output_dir / "final_metrics.json")
