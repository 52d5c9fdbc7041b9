"""RolloutLoop: the one owner of a rollout round, from the round's prompts to the micro-batches a step trains on.

One round's path from prompts to optimizer step reads top to bottom in three files:

1. `grpo_lightning/training/rollout_loop.py` (this file): `produce` syncs the generator's weights, samples the round
   (round_sampling.py: the variant, with dynamic sampling when on), and `finish` lays the rollouts out in
   micro-batches (round_layout.py), scores the old log-probs, counts each optimizer step's tokens over all
   ranks, computes the round's metrics and hands the data module a read-only `Round`; `on_train_epoch_end`
   runs the end of a round, phase by phase.
2. `grpo_lightning/training/module.py`: `GRPOModule.training_step`, one micro-batch's log-probs, loss and guards.
3. `grpo_lightning/algorithm/losses.py`: `GRPOLoss`, the clipped surrogate, the KL term and the loss type's aggregation.

The data module serves the `Round` it is given and nothing else: no calls into the module, no collectives.

Lightning builds the epoch's data loader BEFORE `on_train_epoch_start` (and, for epoch 0, even before
`on_train_start`), so round 0 is produced in `on_fit_start` and round k+1 at the end of round k; the trainer
runs with `reload_dataloaders_every_n_epochs=1`.

Exact resume: Lightning saves checkpoints at the end of a round AFTER this loop has generated the next round
(checkpoint callbacks run last), so `state_dict` holds the next round's rollouts and the RNG states as they are
at that moment. A resumed run installs those rollouts instead of sampling again and restores the RNGs, so it
continues bit for bit. A checkpoint written without a next round (a graceful stop) resumes by generating it
from the saved RNG states, which is what the uninterrupted run did at that point.

Overlapped rounds (`rollout.max_staleness` >= 1, overlap.py, docs/overlap.md): round k+1 is sampled by an engine
copy in a worker thread while round k trains, from the weights round k started with; `on_train_epoch_start`
starts it and `on_train_epoch_end` joins it and `finish`es it as a sequential round, before the checkpoint, so
the checkpoint still holds the next round's rollouts; the round after is started from the checkpoint's weights
with its own seed, and a resumed run samples it again, identically.

Several processes (DDP): each rank generates the rollouts of its block of the round's prompts with its own RNG
stream (seeded from (seed, rank)), so the run is reproducible for a given number of processes; round metrics
are computed over every rank's rollouts; checkpoints hold every rank's rollouts and RNG states.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import lightning as L
import torch

from grpo_lightning.accel.heap_trim import release_freed_memory
from grpo_lightning.algorithm.round_metrics import LogpAgreement, RolloutStats, credited_tokens, round_metrics
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.distributed import derive_seed, gather_objects, lost_a_process, rank_and_world
from grpo_lightning.rng import capture_rng, restore_rng
from grpo_lightning.training import tracking
from grpo_lightning.training.overlap import (
    ABANDON_WAIT_S,
    BackgroundSampling,
    RolloutSettings,
    background_sampling,
    staleness_problem,
)
from grpo_lightning.training.round_layout import micro_batches_of, round_of
from grpo_lightning.training.round_sampling import RoundSampler, SampledRound
from grpo_lightning.types import Prompt, Rollout

log = logging.getLogger(__name__)


class RolloutLoop(L.Callback):
    def __init__(
        self,
        generator,
        variant,
        reward_fn,
        datamodule: RolloutDataModule,
        tokenizer,
        samples_every_n_rounds: int = 1,
        num_samples_logged: int = 4,
        seed: int = 0,
        stop=None,
        evaluator=None,
        max_tokens_generated: int | None = None,
        max_staleness: int = RolloutSettings.max_staleness,
        sampler_threads: int | None = RolloutSettings.sampler_threads,
    ) -> None:
        RolloutSettings(max_staleness, sampler_threads)  # the keys' rules (one declaration)
        self.generator = generator
        self.reward_fn = reward_fn
        self.datamodule = datamodule
        self.tokenizer = tokenizer
        self.sampler = RoundSampler(variant, reward_fn, datamodule, tokenizer)
        """Sampling a round (round_sampling.py): what the overlap worker runs."""
        self.samples_every_n_rounds = samples_every_n_rounds
        self.num_samples_logged = num_samples_logged
        self.seed = seed
        self.stop = stop
        """The graceful stop (interrupt.py), asked at every round end whether a signal arrived."""
        self.guard = generator.guard
        """The generator's stale-weight guard (generation/stale_guard.py), told of every round."""
        self.evaluator = evaluator
        """The GSM8K evaluator (evaluation.py), run at the start and after the rounds it is due."""
        self.max_tokens_generated = max_tokens_generated
        """The token budget (`max_tokens_generated`): the run ends at the first round end at which
        `tokens_generated_total` reaches it; None: `trainer.max_epochs` rounds."""
        self.max_staleness = max_staleness
        self.sampler_threads = sampler_threads
        self.background: BackgroundSampling | None = None
        """With `rollout.max_staleness` >= 1: the engine copy that samples the next round beside the trainer."""
        self._start_fresh()

    def _start_fresh(self) -> None:
        """The loop's own state before any round: what a checkpoint carries (`state_dict`) and the round in hand."""
        self.prompt_cursor = 0
        """Dynamic sampling: the prompt stream position of the next unused prompt."""
        self.history: list[tuple[int, float, float]] = []
        """(round, train/reward_mean, rollout/format_rate) of every round produced so far (run summary)."""
        self.rounds_trained = 0
        """Rounds this process trained in this fit (0 for a resumed run that had none left)."""
        self.round_metrics: dict[str, float] = {}
        self.tokens_generated_total = 0.0
        """Completion tokens sampled by every rank since the run began, dynamic sampling's dropped groups included:
        the compute axis on which variants compare (`rollout/tokens_generated_total`)."""
        self._train_start = 0.0
        self._step_seen = 0
        """The optimizer step last seen at a batch's end (a step just happened when it moved)."""
        self._push_in_flight_s = 0.0
        """Seconds the round's training spent pushing weights to an engine sampling beside it."""
        self.next_round = 0
        """The round to train next (what a checkpoint written now resumes at)."""
        self.pending: list[Rollout] | None = None
        """That round's rollouts, once generated."""
        self.agreement = LogpAgreement()
        """Generator / trainer log-prob agreement of the round being trained."""
        self.agreement_judged = False
        """Whether this round's agreement was judged against the another-model bound (before its first update)."""
        self.scored = False
        """Whether the round being trained had its old log-probs scored before its first update."""
        self._resume_state: dict | None = None

    def decode(self, ids: list[int]) -> str:
        return self.sampler.decode(ids)

    # ---- checkpoint state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Called on every rank when a checkpoint is written; rank 0 writes everybody's part. With overlap and no
        next round (the last round), the engine copy's snapshot too: a run extended from this checkpoint samples
        that round from the weights the longer run sampled it from."""
        local = {
            "pending": None if self.pending is None else [dataclasses.asdict(r) for r in self.pending],
            "rng": capture_rng(),
            "reward": self.reward_fn.state_dict(),  # e.g. an EMA baseline across rounds
            "variant": self.sampler.variant.state_dict(),  # e.g. self-play's opponent pool, as after the pending round
        }
        sampler = self.background.state_dict() if self.background is not None and self.pending is None else None
        return {
            "next_round": self.next_round,
            "round_metrics": dict(self.round_metrics),
            "prompt_cursor": self.prompt_cursor,
            "tokens_generated_total": self.tokens_generated_total,
            "history": list(self.history),
            "ranks": gather_objects(local),
            "sampler": sampler,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_state = state_dict  # applied in on_fit_start, once the policy weights are restored

    # ---- the run's start, a round's start and end ----------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Round 0 (or the checkpoint's next round), then the evaluation at the start."""
        if self.max_staleness > 0:  # every rank, in the same order: the worker's process group
            self.background = background_sampling(self.generator, pl_module.policy, self.sampler_threads)
        self.start_or_resume(trainer, pl_module)
        if self.evaluator is not None:
            self.evaluator.at_fit_start(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The round's metrics, logged at the round's own steps (it was sampled at the end of the previous
        epoch, because Lightning builds an epoch's data loader before this hook runs); with overlap, the next
        round's sampling starts beside this round's training."""
        # Round metrics are already over all ranks (identical everywhere); sync_dist only averages equal values.
        pl_module.log_dict(self.round_metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
        reward = self.round_metrics["train/reward_mean"]
        pl_module.log("reward", reward, prog_bar=True, logger=False, batch_size=1, sync_dist=True)
        self.next_round, self.pending = trainer.current_epoch + 1, None  # this round is being consumed
        if self.background is not None:
            self.start_next(trainer, pl_module)
        self._step_seen = trainer.global_step
        self._train_start = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        if not self.scored:  # one optimizer step per round: the step's own log-probs are the pre-update ones
            self.agreement.add(pl_module.last_old_logprobs, pl_module.last_batch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        """After an optimizer step that is not the round's last, while the next round is sampled beside it: the
        engine copy may take the weights now (`BackgroundEngine.push_in_flight`: servers with
        `generator.push_in_flight`); the round's last step is pushed as the next round starts training. Every
        process steps together, so every process pushes together (the push ends in a barrier)."""
        stepped, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        last = batch_idx + 1 >= trainer.num_training_batches
        if stepped and not last and self.background is not None and self.background.in_flight:
            start = time.perf_counter()
            if self.background.engine.push_in_flight(pl_module.policy):
                self._push_in_flight_s += time.perf_counter() - start

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        """Before the round's first update: a round another model sampled is never trained on (the guard's
        `another_model` bound, judged on the agreement over every rank, so all stop alike)."""
        if self.agreement_judged or self.guard.another_model is None:
            return
        self.agreement_judged = True
        sums = torch.tensor([self.agreement.total, self.agreement.count], dtype=torch.float64, device=pl_module.device)
        total, count = (float(x) for x in trainer.strategy.reduce(sums, reduce_op="sum"))
        if count > 0:
            self.guard.check_another_model(trainer.current_epoch, total / count)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The end of a round, in order: its timing and log-prob agreement, the stop check, the next round's
        rollouts, the evaluation. Checkpoints follow (Lightning runs them after every other callback)."""
        self.rounds_trained += 1
        train_s = time.perf_counter() - self._train_start
        pl_module.log("time/train_s", train_s, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
        if self._push_in_flight_s:  # included in time/train_s
            pl_module.log("time/push_in_flight_s", self._push_in_flight_s, on_epoch=True, batch_size=1,
                          sync_dist=True, reduce_fx="max")  # fmt: skip
            self._push_in_flight_s = 0.0
        agreement = self.agreement.metrics()
        for key, reduce in (("rollout/logp_diff_mean", "mean"), ("rollout/logp_diff_max", "max")):
            pl_module.log(key, agreement[key], on_epoch=True, batch_size=1, sync_dist=True, reduce_fx=reduce)
        # the value just logged, averaged over ranks: every rank judges the same
        self.guard.check(trainer.current_epoch, trainer.callback_metrics.get("rollout/logp_diff_mean"))
        if self.stop is not None:
            self.stop.after_round(trainer)  # a signal: no next round; the checkpoint is written as usual
        spent = self.budget_spent()
        if spent:  # the run's last round, ended like a graceful stop (no next round), evaluated like the last
            log.info("token budget reached: %.0f tokens generated", self.tokens_generated_total)
            trainer.should_stop = True
        next_round = trainer.current_epoch + 1
        more = self.has_round(trainer, next_round)
        if self.background is not None:
            self.finish_next(trainer, pl_module, next_round)
        elif more and not trainer.should_stop:  # a graceful stop, the token budget or the non-finite guard ends here
            self.produce(trainer, pl_module, next_round)
        if self.evaluator is not None:
            # The engine holds older weights when no next round synced it, or when rounds overlap (it holds the
            # weights this round started from): give engines with their own copy (vLLM) the weights just trained.
            stale_engine = not more or trainer.should_stop or self.background is not None
            if stale_engine and self.evaluator.is_due(trainer, pl_module, last_round=spent):
                self.generator.push_weights()
            self.evaluator.after_round(trainer, pl_module, last_round=spent)

    def budget_spent(self) -> bool:
        """Whether the rounds trained so far generated `max_tokens_generated` tokens or more. Asked at a round's
        end, before the next round is sampled, so the total is that of the rounds trained: every run of a
        comparison stops at the first round end past the same budget (docs/learning.md). The total is the same on
        every rank (it is summed over all of them), so all ranks decide alike."""
        return self.max_tokens_generated is not None and self.tokens_generated_total >= self.max_tokens_generated

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A failing run ends the round being sampled beside it. With another training process gone, without
        waiting for it: the run must report and stop within seconds (Lightning's launcher kills the first process
        5 s after it sees another die); the worker is a daemon thread, and the generator's close ends what it
        waits on."""
        if self.background is not None:
            self.background.abandon(wait_s=0.0 if lost_a_process(exception) else ABANDON_WAIT_S)
            self.background.all_threads()

    @staticmethod
    def has_round(trainer: L.Trainer, round_index: int) -> bool:
        return trainer.max_epochs is None or round_index < trainer.max_epochs

    def start_or_resume(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state, self._resume_state = self._resume_state, None
        rank, world_size = rank_and_world()
        if state is None:
            if world_size > 1:  # one RNG stream per rank, reproducible for this number of processes
                torch.manual_seed(derive_seed(self.seed, "rank", rank))
            self.produce_now(trainer, pl_module, 0)
            return
        if len(state["ranks"]) != world_size:
            raise ValueError(
                f"ckpt_path: the checkpoint was written by {len(state['ranks'])} processes and this run has "
                f"{world_size}; resume with the same trainer.devices x trainer.num_nodes"
            )
        mine = state["ranks"][rank]
        self.prompt_cursor = state.get("prompt_cursor", 0)
        self.tokens_generated_total = state.get("tokens_generated_total", 0.0)  # the pending round's included
        self.history = [tuple(h) for h in state.get("history", [])]
        if mine.get("reward"):
            self.reward_fn.load_state_dict(mine["reward"])
        self.sampler.variant.load_state_dict(mine.get("variant") or {})
        if mine["pending"] is None:
            restore_rng(mine["rng"])
            self.produce_now(trainer, pl_module, state["next_round"], state.get("sampler"))
            return
        rollouts = [Rollout.from_dict(r) for r in mine["pending"]]
        if state["round_metrics"].get("rollout/staleness", 0.0) > 0:  # sampled beside the previous round's training
            self.guard.round_sampled(stale=True)  # from older weights on purpose: the stale-weight guard skips it
        self.install(trainer, pl_module, rollouts, state["next_round"])
        self.round_metrics = {k: v for k, v in state["round_metrics"].items() if not k.startswith("rollout/logp_diff")}
        restore_rng(mine["rng"])
        log.info("resumed at round %d with its saved rollouts", state["next_round"])

    # ---- one round -----------------------------------------------------------------------------------------
    def produce(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int) -> None:
        """Sync, sample, score, gather: the next round's rollouts, installed, and its metrics."""
        start = time.perf_counter()
        self.generator.sync_weights(pl_module.policy)
        sync_s = time.perf_counter() - start
        self.generator.reseed(derive_seed(self.seed, "round", round_index))  # engines that seed per prefix (HF)
        start = time.perf_counter()
        release_freed_memory()  # the training phase's freed activations, before generation adds its own
        with self.generator.sampling_session():  # trainer=fsdp: the HF engine samples from the gathered policy
            sampled = self.sampler.sample(self.generator, round_index, self.prompt_cursor)
        release_freed_memory()  # generation's merged / packed weights and KV cache, before training
        sampled.rollout_s = time.perf_counter() - start
        self.finish(trainer, pl_module, sampled, round_index, staleness=0)
        self.round_metrics["time/weight_sync_s"] = sync_s  # logged as the mean over ranks

    def produce_now(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int, snapshot=None) -> None:
        """A round with nothing to overlap (the first, or one a checkpoint does not hold): `produce`; with overlap
        the engine copy samples it in its worker from the current weights, or from a checkpoint's `snapshot`."""
        if self.background is None:
            self.produce(trainer, pl_module, round_index)
            return
        if snapshot is not None:
            self.background.load_state_dict(snapshot)
        else:
            self.background.snapshot(pl_module.policy, trainer.global_step)
        sampled = self.background.run_now(*self.sampling_job(round_index))
        self.finish(trainer, pl_module, sampled, round_index, trainer.global_step - self.background.snapshot_step)

    def start_next(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Overlap, as round k starts training: its weights into the engine copy, round k+1 sampled beside it."""
        self.background.snapshot(pl_module.policy, trainer.global_step)  # also for the last round (state_dict)
        next_round = trainer.current_epoch + 1
        if self.has_round(trainer, next_round):
            self.background.start(*self.sampling_job(next_round))
        self.background.trainer_threads()

    def sampling_job(self, round_index: int):
        """The overlap worker's job for a round: its seed, and the sampling from the stream position now."""
        cursor = self.prompt_cursor

        def work(engine, group):
            return self.sampler.sample(engine, round_index, cursor, group)

        return derive_seed(self.seed, "round", round_index), work

    def finish_next(self, trainer: L.Trainer, pl_module: L.LightningModule, next_round: int) -> None:
        """Overlap, as round k ends: round k+1 joined and installed, even when the run stops here (the checkpoint
        keeps it: no later checkpoint holds the weights it was sampled from)."""
        self.background.all_threads()
        if self.background.in_flight:
            start = time.perf_counter()
            sampled = self.background.join()
            wait_s = time.perf_counter() - start  # > 0: sampling is the longer side
            pl_module.log("time/rollout_wait_s", wait_s, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
            self.finish(trainer, pl_module, sampled, next_round, trainer.global_step - self.background.snapshot_step)

    def finish(
        self, trainer: L.Trainer, pl_module: L.LightningModule, sampled: SampledRound, round_index: int, staleness: int
    ) -> None:
        """Install a sampled round and compute its metrics over all ranks (`staleness`: the optimizer steps between
        the weights that sampled it and those it trains first)."""
        problem = staleness_problem(staleness, self.max_staleness)
        if problem is not None:
            raise ValueError(problem)
        self.prompt_cursor = sampled.prompt_cursor
        self.guard.round_sampled(stale=staleness > 0)
        rank, _ = rank_and_world()
        local = {
            "stats": [RolloutStats.of(r, rank) for r in sampled.sampled],
            "rollout_s": sampled.rollout_s,
            "variant": sampled.variant_metrics,
            "reward_errors": sampled.reward_errors,
            "sampling": sampled.sampling_metrics,
            "engine": self.generator.engine_metrics(),
            "credit": credited_tokens(sampled.rollouts),
        }
        self.round_metrics = round_metrics(gather_objects(local))
        self.round_metrics["rollout/staleness"] = float(staleness)
        self.tokens_generated_total += self.round_metrics["rollout/tokens_generated"]
        self.round_metrics["rollout/tokens_generated_total"] = self.tokens_generated_total
        rollouts = sampled.rollouts
        self.install(trainer, pl_module, rollouts, round_index)
        self.history.append(
            (round_index, self.round_metrics["train/reward_mean"], self.round_metrics["rollout/format_rate"])
        )
        log.info(
            "round %d: reward %.3f, %d rollouts in %.1f s",
            round_index,
            self.round_metrics["train/reward_mean"],
            len(rollouts),
            sampled.rollout_s,
        )
        if trainer.is_global_zero and round_index % self.samples_every_n_rounds == 0:
            self.log_samples(trainer, sampled.prompts, rollouts)

    def install(self, trainer: L.Trainer, pl_module: L.LightningModule, rollouts: list[Rollout], round_index: int):
        """Lay the round out, score its old log-probs when several optimizer steps use it (before any update:
        "detached current" is wrong after the first), and hand the data module the finished `Round`."""
        dm = self.datamodule
        accumulate = trainer.accumulate_grad_batches
        micro_batches = micro_batches_of(rollouts, dm.settings.groups_per_micro_batch, self.tokenizer.pad_token_id)
        self.scored = (
            dm.micro_batches_per_round * dm.settings.num_iterations > accumulate
        )  # more than one optimizer step
        self.agreement = LogpAgreement()
        self.agreement_judged = False
        if self.scored:
            for mb in micro_batches:
                mb.old_logprobs = pl_module.score_old_logprobs(mb.to(pl_module.device)).float().cpu()  # [B, C]
                self.agreement.add(mb.old_logprobs, mb)
        dm.serve(round_of(round_index, rollouts, micro_batches, accumulate, dm.settings))
        self.next_round, self.pending = round_index, rollouts

    def log_samples(self, trainer: L.Trainer, prompts: list[Prompt], rollouts: list[Rollout]) -> None:
        """Text table of a few completions and reward / advantage histograms, at the round's first step."""
        step = trainer.global_step
        columns = (
            tracking.Column("group"),
            tracking.Column("reward", ".2f"),
            tracking.Column("advantage", "+.2f"),
            tracking.Column("question", max_chars=200),
            tracking.Column("completion", max_chars=1500),
        )
        rows = []
        for r in rollouts[: self.num_samples_logged]:
            question = prompts[r.group_id].question if r.group_id < len(prompts) else ""
            rows.append((r.group_id, r.reward, r.advantage, question, r.text))
        tracking.log_table(trainer.loggers, "rollout/samples", tracking.Table(columns, tuple(rows)), step)
        tracking.log_histogram(trainer.loggers, "rollout/reward_hist", [r.reward for r in rollouts], step)
        tracking.log_histogram(trainer.loggers, "rollout/advantage_hist", [r.advantage for r in rollouts], step)
