"""RolloutLoop: the one owner of a rollout round, from the round's prompts to the micro-batches a step trains on.

One round's path from prompts to optimizer step reads top to bottom in three files:

1. `grpo_lightning/training/rollout_loop.py` (this file): `produce` syncs the generator's weights, samples the round
   (the variant, with dynamic sampling when on), lays the rollouts out in micro-batches (`layout`), scores the
   old log-probs, counts each optimizer step's tokens over all ranks, computes the round's metrics and hands
   the data module a read-only `Round`; `on_train_epoch_end` runs the end of a round, phase by phase.
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
from grpo_lightning.algorithm.dynamic_sampling import groups_in_order, is_informative, renumbered
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.algorithm.round_metrics import LogpAgreement, RolloutStats, round_metrics
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.distributed import (
    derive_seed,
    full_parameters,
    gather_objects,
    rank_and_world,
    shard,
    sum_across_ranks,
)
from grpo_lightning.rng import capture_rng, restore_rng
from grpo_lightning.training import tracking
from grpo_lightning.types import Prompt, Rollout, RolloutBatch, Round

log = logging.getLogger(__name__)


def micro_batches_of(rollouts: list[Rollout], groups_per_micro_batch: int, pad_token_id: int) -> list[RolloutBatch]:
    """Collate the round's rollouts into micro-batches of `groups_per_micro_batch` whole advantage groups."""
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    group_list = list(groups.values())
    if len(group_list) % groups_per_micro_batch:
        raise ValueError(
            f"the round has {len(group_list)} groups, not a multiple of data.groups_per_micro_batch "
            f"({groups_per_micro_batch})"
        )
    k = groups_per_micro_batch
    return [
        collate_rollouts([r for g in group_list[i : i + k] for r in g], pad_token_id)
        for i in range(0, len(group_list), k)
    ]


def pass_order(num_micro_batches: int, num_iterations: int, seed: int, round_index: int) -> list[int]:
    """Micro-batch indices in training order: pass 0 in order, later passes shuffled (seeded by round and pass)."""
    order: list[int] = []
    for it in range(num_iterations):
        ids = list(range(num_micro_batches))
        if it > 0:
            gen = torch.Generator().manual_seed(seed * 7919 + round_index * 31 + it)
            ids = torch.randperm(len(ids), generator=gen).tolist()
        order.extend(ids)
    return order


def step_schedule(micro_batches: list[RolloutBatch], order: list[int], accumulate: int) -> list[RolloutBatch]:
    """The micro-batches in `order`, each told the trained tokens of its optimizer step summed over all ranks
    (a collective: every rank calls it with the same number of steps)."""
    steps = [order[start : start + accumulate] for start in range(0, len(order), accumulate)]
    local = torch.tensor(  # [num_steps] trained tokens of each optimizer step on this rank
        [sum(float(micro_batches[i].completion_mask.sum()) for i in step) for step in steps],
        dtype=torch.float64,
    )
    tokens = sum_across_ranks(local).tolist()  # dapo: the whole step, all ranks (docs/algorithm.md)
    return [
        dataclasses.replace(micro_batches[i], num_tokens_in_step=n)
        for step, n in zip(steps, tokens, strict=True)
        for i in step
    ]


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
    ) -> None:
        self.generator = generator
        self.variant = variant
        self.reward_fn = reward_fn
        self.datamodule = datamodule
        self.tokenizer = tokenizer
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
        self.prompt_cursor = 0
        """Dynamic sampling: the prompt stream position of the next unused prompt."""
        self.history: list[tuple[int, float, float]] = []
        """(round, train/reward_mean, rollout/format_rate) of every round produced so far (run summary)."""
        self.round_metrics: dict[str, float] = {}
        self.tokens_generated_total = 0.0
        """Completion tokens sampled by every rank since the run began, dynamic sampling's dropped groups included:
        the compute axis on which variants compare (`rollout/tokens_generated_total`)."""
        self._train_start = 0.0
        self.next_round = 0
        """The round to train next (what a checkpoint written now resumes at)."""
        self.pending: list[Rollout] | None = None
        """That round's rollouts, once generated."""
        self.agreement = LogpAgreement()
        """Generator / trainer log-prob agreement of the round being trained."""
        self.scored = False
        """Whether the round being trained had its old log-probs scored before its first update."""
        self._resume_state: dict | None = None

    @property
    def state_key(self) -> str:
        """The checkpoint key of this state: the class's former name, kept because renaming it would only churn."""
        return "RolloutCallback"

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- checkpoint state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Called on every rank when a checkpoint is written; rank 0 writes everybody's part."""
        local = {
            "pending": None if self.pending is None else [dataclasses.asdict(r) for r in self.pending],
            "rng": capture_rng(),
            "reward": self.reward_fn.state_dict(),  # e.g. an EMA baseline across rounds
        }
        return {
            "next_round": self.next_round,
            "round_metrics": dict(self.round_metrics),
            "prompt_cursor": self.prompt_cursor,
            "tokens_generated_total": self.tokens_generated_total,
            "history": list(self.history),
            "ranks": gather_objects(local),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_state = state_dict  # applied in on_fit_start, once the policy weights are restored

    # ---- the run's start, a round's start and end ----------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Round 0 (or the checkpoint's next round), then the evaluation at the start."""
        self.start_or_resume(trainer, pl_module)
        if self.evaluator is not None:
            self.evaluator.at_fit_start(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The round's metrics, logged at the round's own steps (it was sampled at the end of the previous
        epoch, because Lightning builds an epoch's data loader before this hook runs)."""
        # Round metrics are already over all ranks (identical everywhere); sync_dist only averages equal values.
        pl_module.log_dict(self.round_metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
        reward = self.round_metrics["train/reward_mean"]
        pl_module.log("reward", reward, prog_bar=True, logger=False, batch_size=1, sync_dist=True)
        self._train_start = time.perf_counter()
        self.next_round, self.pending = trainer.current_epoch + 1, None  # this round is being consumed

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.scored:  # one optimizer step per round: the step's own log-probs are the pre-update ones
            self.agreement.add(pl_module.last_old_logprobs, batch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The end of a round, in order: its timing and log-prob agreement, the stop check, the next round's
        rollouts, the evaluation. Checkpoints follow (Lightning runs them after every other callback)."""
        train_s = time.perf_counter() - self._train_start
        pl_module.log("time/train_s", train_s, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
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
        more = trainer.max_epochs is None or next_round < trainer.max_epochs
        if more and not trainer.should_stop:  # a graceful stop, the token budget or the non-finite guard ends here
            self.produce(trainer, pl_module, next_round)
        if self.evaluator is not None:
            if not more or trainer.should_stop:  # no next round synced the engine: give it the weights just trained
                self.generator.push_weights()  # engines with their own copy (vLLM)
            self.evaluator.after_round(trainer, pl_module, last_round=spent)

    def budget_spent(self) -> bool:
        """Whether the rounds trained so far generated `max_tokens_generated` tokens or more. Asked at a round's
        end, before the next round is sampled, so the total is that of the rounds trained: every run of a
        comparison stops at the first round end past the same budget (docs/learning.md). The total is the same on
        every rank (it is summed over all of them), so all ranks decide alike."""
        return self.max_tokens_generated is not None and self.tokens_generated_total >= self.max_tokens_generated

    def start_or_resume(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state, self._resume_state = self._resume_state, None
        rank, world_size = rank_and_world()
        if state is None:
            if world_size > 1:  # one RNG stream per rank, reproducible for this number of processes
                torch.manual_seed(derive_seed(self.seed, "rank", rank))
            self.produce(trainer, pl_module, 0)
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
        if mine["pending"] is None:
            restore_rng(mine["rng"])
            self.produce(trainer, pl_module, state["next_round"])
            return
        rollouts = [Rollout(**r) for r in mine["pending"]]
        self.install(trainer, pl_module, rollouts, state["next_round"])
        self.round_metrics = {k: v for k, v in state["round_metrics"].items() if not k.startswith("rollout/logp_diff")}
        restore_rng(mine["rng"])
        log.info("resumed at round %d with its saved rollouts", state["next_round"])

    # ---- one round -----------------------------------------------------------------------------------------
    def produce(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int) -> None:
        """Sync, sample, score, gather: the next round's rollouts, installed, and its metrics."""
        self.generator.sync_weights(pl_module.policy)
        self.generator.reseed(derive_seed(self.seed, "round", round_index))  # engines that seed per prefix (HF)
        rank, world_size = rank_and_world()
        start = time.perf_counter()
        release_freed_memory()  # the training phase's freed activations, before generation adds its own
        with full_parameters(trainer):  # FSDP: sample from gathered weights
            if self.datamodule.dynamic_sampling.enabled:
                prompts, rollouts, sampled, sampling_metrics = self.sample_informative(rank, world_size)
            else:
                prompts = shard(self.datamodule.prompts_for_round(round_index, self.tokenizer), rank, world_size)
                rollouts = self.variant.generate_rollouts(self.generator, prompts, self.reward_fn, self.decode)
                sampled, sampling_metrics = rollouts, {}
        release_freed_memory()  # generation's merged / packed weights and KV cache, before training
        self.guard.round_sampled()
        rollout_s = time.perf_counter() - start
        local = {
            "stats": [RolloutStats.of(r, rank) for r in sampled],
            "rollout_s": rollout_s,
            "variant": dict(self.variant.metrics),
            "reward_errors": self.reward_fn.pop_errors(),  # failing reward term calls
            "sampling": sampling_metrics,
        }
        self.round_metrics = round_metrics(gather_objects(local))
        self.tokens_generated_total += self.round_metrics["rollout/tokens_generated"]
        self.round_metrics["rollout/tokens_generated_total"] = self.tokens_generated_total
        self.install(trainer, pl_module, rollouts, round_index)
        self.history.append(
            (round_index, self.round_metrics["train/reward_mean"], self.round_metrics["rollout/format_rate"])
        )
        log.info(
            "round %d: reward %.3f, %d rollouts in %.1f s",
            round_index,
            self.round_metrics["train/reward_mean"],
            len(rollouts),
            rollout_s,
        )
        if trainer.is_global_zero and round_index % self.samples_every_n_rounds == 0:
            self.log_samples(trainer, prompts, rollouts)

    def sample_informative(self, rank: int, world_size: int):
        """Dynamic sampling (algorithm/dynamic_sampling.py): batches of fresh prompts until this round has
        `prompts_per_round` groups whose rewards differ, or the cap on extra batches is reached.

        Every rank draws the same number of batches (the stop decision is taken over all ranks), each from its
        block of the same stream positions. Returns the round's prompts and rollouts (group ids 0..n-1, with
        advantages), every rollout sampled on the way (for the round's reward metrics) and the sampling metrics.
        """
        per_round = self.datamodule.prompts_per_round
        needed = per_round // world_size
        kept: list[tuple[Prompt, list[Rollout]]] = []
        dropped: list[tuple[Prompt, list[Rollout]]] = []
        sampled: list[Rollout] = []
        batches = 0
        while True:
            prompts = shard(self.datamodule.prompts_at(self.prompt_cursor, per_round, self.tokenizer), rank, world_size)
            self.prompt_cursor += per_round
            batches += 1
            rollouts = self.variant.sample_rollouts(self.generator, prompts, self.reward_fn, self.decode)
            sampled.extend(dataclasses.replace(r, group_id=r.group_id + (batches - 1) * len(prompts)) for r in rollouts)
            for prompt, group in zip(prompts, groups_in_order(rollouts, len(prompts)), strict=True):
                (kept if is_informative(group) else dropped).append((prompt, group))
            still_short = max(gather_objects(needed - len(kept)))
            if still_short <= 0 or batches > self.datamodule.dynamic_sampling.max_extra_batches:
                break
        chosen = kept[:needed] + dropped[: max(0, needed - len(kept))]
        rollouts = renumbered([group for _, group in chosen])
        self.variant.assign_advantages(rollouts, self.reward_fn)
        metrics = {
            "rollout/ds_groups_filtered": float(len(dropped)),
            "rollout/ds_groups_short": float(max(0, needed - len(kept))),
            "rollout/ds_extra_batches": float(batches - 1),
            "rollout/ds_prompts_consumed": float(batches * len(prompts)),
        }
        return [prompt for prompt, _ in chosen], rollouts, sampled, metrics

    def install(self, trainer: L.Trainer, pl_module: L.LightningModule, rollouts: list[Rollout], round_index: int):
        """Lay the round out, score its old log-probs when several optimizer steps use it (before any update:
        "detached current" is wrong after the first), and hand the data module the finished `Round`."""
        dm = self.datamodule
        accumulate = trainer.accumulate_grad_batches
        micro_batches = micro_batches_of(rollouts, dm.groups_per_micro_batch, self.tokenizer.pad_token_id)
        self.scored = dm.micro_batches_per_round * dm.num_iterations > accumulate  # more than one optimizer step
        self.agreement = LogpAgreement()
        if self.scored:
            for mb in micro_batches:
                mb.old_logprobs = pl_module.score_old_logprobs(mb.to(pl_module.device)).float().cpu()  # [B, C]
                self.agreement.add(mb.old_logprobs, mb)
        dm.serve(self.round_of(round_index, rollouts, micro_batches, accumulate))
        self.next_round, self.pending = round_index, rollouts

    def round_of(self, round_index: int, rollouts: list[Rollout], micro_batches: list[RolloutBatch], accumulate: int):
        """The `Round` the data module serves: the micro-batches in pass order, each with its step's tokens."""
        order = pass_order(len(micro_batches), self.datamodule.num_iterations, self.datamodule.seed, round_index)
        schedule = step_schedule(micro_batches, order, accumulate)
        return Round(round_index, tuple(rollouts), tuple(micro_batches), tuple(schedule))

    def layout(self, rollouts: list[Rollout], round_index: int, accumulate: int) -> Round:
        """A round laid out without a trainer and without old log-probs (benchmarks drive rounds by hand)."""
        micro_batches = micro_batches_of(rollouts, self.datamodule.groups_per_micro_batch, self.tokenizer.pad_token_id)
        return self.round_of(round_index, rollouts, micro_batches, accumulate)

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
