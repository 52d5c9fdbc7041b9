"""RolloutCallback: produces each round's rollouts and logs what they look like.

Lightning builds the epoch's data loader BEFORE `on_train_epoch_start` (and, for epoch 0, even before
`on_train_start`), so round 0 is produced in `on_fit_start` and round k+1 in `on_train_epoch_end` of round k;
the trainer runs with `reload_dataloaders_every_n_epochs=1`.

Exact resume: Lightning saves checkpoints at the end of a round AFTER this callback has generated the next
round (ModelCheckpoint runs last), so `state_dict` holds the next round's rollouts and the RNG states as they
are at that moment. A resumed run installs those rollouts instead of sampling again and restores the RNGs, so
it continues bit for bit. A checkpoint written without a next round (a graceful stop) resumes by generating it
from the saved RNG states, which is what the uninterrupted run did at that point.

Several processes (DDP): each rank generates the rollouts of its block of the round's prompts with its own RNG
stream (seeded from (seed, rank)), so the run is reproducible for a given number of processes; round metrics
are computed over every rank's rollouts; checkpoints hold every rank's rollouts and RNG states.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from grpo_lightning.advantages import zero_std_group_fraction
from grpo_lightning.checkpointing import capture_rng, restore_rng
from grpo_lightning.data.datamodule import Prompt, RolloutDataModule
from grpo_lightning.distributed import derive_seed, full_parameters, gather_objects, rank_and_world, shard
from grpo_lightning.dynamic_sampling import groups_in_order, is_informative, renumbered
from grpo_lightning.memory import release_freed_memory
from grpo_lightning.rollouts import Rollout, RolloutBatch

log = logging.getLogger(__name__)


class RolloutCallback(L.Callback):
    def __init__(
        self,
        generator,
        variant,
        reward_fn,
        datamodule: RolloutDataModule,
        decode,
        samples_every_n_rounds: int = 1,
        num_samples_logged: int = 4,
        seed: int = 0,
    ) -> None:
        self.generator = generator
        self.variant = variant
        self.reward_fn = reward_fn
        self.datamodule = datamodule
        self.decode = decode
        self.samples_every_n_rounds = samples_every_n_rounds
        self.num_samples_logged = num_samples_logged
        self.seed = seed
        self.prompt_cursor = 0
        """Dynamic sampling: the prompt stream position of the next unused prompt."""
        self.history: list[tuple[int, float, float]] = []
        """(round, train/reward_mean, rollout/format_rate) of every round produced so far (run summary)."""
        self.round_metrics: dict[str, float] = {}
        self._train_start = 0.0
        self.next_round = 0
        """The round to train next (what a checkpoint written now resumes at)."""
        self.pending: list[Rollout] | None = None
        """That round's rollouts, once generated."""
        self._resume_state: dict | None = None

    # ---- checkpoint state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Called on every rank when a checkpoint is written; rank 0 writes everybody's part."""
        reward_state = getattr(self.reward_fn, "state_dict", None)  # e.g. an EMA baseline across rounds
        local = {
            "pending": None if self.pending is None else [dataclasses.asdict(r) for r in self.pending],
            "rng": capture_rng(),
            "reward": reward_state() if reward_state is not None else {},
        }
        return {
            "next_round": self.next_round,
            "round_metrics": dict(self.round_metrics),
            "prompt_cursor": self.prompt_cursor,
            "history": list(self.history),
            "ranks": gather_objects(local),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_state = state_dict  # applied in on_fit_start, once the policy weights are restored

    # ---- hooks ---------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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
        self.history = [tuple(h) for h in state.get("history", [])]
        if mine.get("reward"):
            self.reward_fn.load_state_dict(mine["reward"])
        if mine["pending"] is None:
            restore_rng(mine["rng"])
            self.produce(trainer, pl_module, state["next_round"])
            return
        self.install(trainer, pl_module, [Rollout(**r) for r in mine["pending"]], state["next_round"])
        self.round_metrics = state["round_metrics"]
        restore_rng(mine["rng"])
        log.info("resumed at round %d with its saved rollouts", state["next_round"])

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Round metrics are already over all ranks (identical everywhere); sync_dist only averages equal values.
        pl_module.log_dict(self.round_metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
        reward = self.round_metrics["train/reward_mean"]
        pl_module.log("reward", reward, prog_bar=True, logger=False, batch_size=1, sync_dist=True)
        self._train_start = time.perf_counter()
        self.next_round, self.pending = trainer.current_epoch + 1, None  # this round is being consumed

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        train_s = time.perf_counter() - self._train_start
        pl_module.log("time/train_s", train_s, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
        next_round = trainer.current_epoch + 1
        more = trainer.max_epochs is None or next_round < trainer.max_epochs
        if more and not trainer.should_stop:  # a graceful stop or the non-finite guard ends the run here
            self.produce(trainer, pl_module, next_round)

    # ---- one round -----------------------------------------------------------------------------------------
    def produce(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int) -> None:
        self.generator.sync_weights(pl_module.policy)
        reseed = getattr(self.generator, "reseed", None)  # engines that can seed per prefix (HF)
        if reseed is not None:
            reseed(derive_seed(self.seed, "round", round_index))
        rank, world_size = rank_and_world()
        start = time.perf_counter()
        release_freed_memory()  # the training phase's freed activations, before generation adds its own
        with full_parameters(trainer):  # FSDP: sample from gathered weights
            if self.datamodule.dynamic_sampling.enabled:
                prompts, rollouts, sampled, sampling_metrics = self.sample_informative(rank, world_size)
            else:
                prompts = shard(self.datamodule.prompts_for_round(round_index), rank, world_size)
                rollouts = self.variant.generate_rollouts(self.generator, prompts, self.reward_fn, self.decode)
                sampled, sampling_metrics = rollouts, {}
        release_freed_memory()  # generation's merged / packed weights and KV cache, before training
        rollout_s = time.perf_counter() - start
        pop_errors = getattr(self.reward_fn, "pop_errors", None)  # SafeReward counts failing reward calls
        local = {
            "stats": [RolloutStats.of(r, rank) for r in sampled],
            "rollout_s": rollout_s,
            "variant": dict(self.variant.metrics),
            "reward_errors": pop_errors() if pop_errors is not None else None,
            "sampling": sampling_metrics,
        }
        self.round_metrics = round_metrics(gather_objects(local)) | self.install(
            trainer, pl_module, rollouts, round_index
        )
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
        """Dynamic sampling (grpo_lightning/dynamic_sampling.py): batches of fresh prompts until this round has
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
            prompts = shard(self.datamodule.prompts_at(self.prompt_cursor, per_round), rank, world_size)
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
        """Hand a round's rollouts to the data module (scoring old log-probs first when the round takes several
        optimizer steps); returns the log-prob agreement metrics that scoring yields."""
        micro_batches = self.datamodule.micro_batches_per_round * self.datamodule.num_iterations
        several_steps = micro_batches > trainer.accumulate_grad_batches  # more than one optimizer step this round
        scorer = (lambda mb: pl_module.score_old_logprobs(mb.to(pl_module.device))) if several_steps else None
        self.datamodule.set_rollouts(rollouts, round_index, trainer.accumulate_grad_batches, scorer)
        self.next_round, self.pending = round_index, rollouts
        return logp_diff(self.datamodule.micro_batches) if several_steps else {}  # this rank's share

    def log_samples(self, trainer: L.Trainer, prompts: list[Prompt], rollouts: list[Rollout]) -> None:
        """Text table of a few completions and reward / advantage histograms, at the round's first step."""
        writer = next((lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if writer is None:
            return
        step = trainer.global_step
        rows = ["| group | reward | advantage | question | completion |", "|---|---|---|---|---|"]
        for r in rollouts[: self.num_samples_logged]:
            question = prompts[r.group_id].question if r.group_id < len(prompts) else ""
            cells = [
                str(r.group_id),
                f"{r.reward:.2f}",
                f"{r.advantage:+.2f}",
                markdown_cell(question, 200),
                markdown_cell(r.text, 1500),
            ]
            rows.append("| " + " | ".join(cells) + " |")
        writer.add_text("rollout/samples", "\n".join(rows), step)
        writer.add_histogram("rollout/reward_hist", torch.tensor([r.reward for r in rollouts]), step)
        writer.add_histogram("rollout/advantage_hist", torch.tensor([r.advantage for r in rollouts]), step)


@dataclass(frozen=True)
class RolloutStats:
    """What round metrics need of one rollout (small enough to gather from every rank)."""

    reward: float
    group: int
    """Group id, unique across ranks."""
    length: int
    generated: int
    """Sampled tokens (a STORPO continuation's branched prefix was sampled once, by the initial completion)."""
    truncated: bool
    extracted: bool
    terms: dict[str, float] = dataclasses.field(default_factory=dict)
    """Unweighted reward terms (`reward.terms.<name>`)."""

    @staticmethod
    def of(r: Rollout, rank: int = 0) -> RolloutStats:
        return RolloutStats(
            reward=r.reward,
            group=rank * 1_000_000 + r.group_id,
            length=len(r.completion_ids),
            generated=len(r.completion_ids) - r.branch_point,
            truncated=r.truncated,
            extracted=r.answer_extracted,
            terms=dict(r.reward_terms),
        )


def round_metrics(per_rank: list[dict]) -> dict[str, float]:
    """Metrics of a whole round from every rank's part (stats over all rollouts; variant metrics: rank mean)."""
    stats = [s for part in per_rank for s in part["stats"]]
    metrics = rollout_metrics(stats, max(part["rollout_s"] for part in per_rank))  # ranks generate in parallel
    for key in per_rank[0]["variant"]:
        metrics[key] = sum(part["variant"][key] for part in per_rank) / len(per_rank)
    for key in per_rank[0]["sampling"]:  # dynamic sampling: counts over all ranks (extra batches: equal on all)
        values = [part["sampling"][key] for part in per_rank]
        metrics[key] = values[0] if key == "rollout/ds_extra_batches" else sum(values)
    if per_rank[0]["reward_errors"] is not None:
        metrics["rollout/reward_errors"] = float(sum(part["reward_errors"] for part in per_rank))
    return metrics


def rollout_metrics(stats: list[RolloutStats], rollout_s: float) -> dict[str, float]:
    """Round-level metrics (TRL meanings): reward stats, zero-std groups, completion lengths, throughput."""
    rewards = torch.tensor([s.reward for s in stats], dtype=torch.float32)  # [N]
    groups = torch.tensor([s.group for s in stats], dtype=torch.long)  # [N]
    lengths = torch.tensor([s.length for s in stats], dtype=torch.float32)  # [N]
    generated = sum(s.generated for s in stats)
    num_groups = len(set(groups.tolist()))
    metrics = {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if len(stats) > 1 else 0.0,
        "train/frac_zero_std_groups": zero_std_group_fraction(rewards, groups),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(s.truncated for s in stats) / len(stats),
        "rollout/format_rate": sum(s.extracted for s in stats) / len(stats),
        "rollout/group_size_mean": len(stats) / num_groups,
        "rollout/tokens_generated_per_prompt": generated / num_groups,
        "rollout/tokens_per_s": generated / max(rollout_s, 1e-9),
        "time/rollout_s": rollout_s,
    }
    names = dict.fromkeys(name for s in stats for name in s.terms)  # in config order
    if names:  # each reward term beside the total, so a user sees which term moves
        metrics["reward/total_mean"] = metrics["train/reward_mean"]
        for name in names:
            values = [s.terms[name] for s in stats if name in s.terms]
            metrics[f"reward/{name}_mean"] = sum(values) / len(values)
    return metrics


def logp_diff(micro_batches: list[RolloutBatch]) -> dict[str, float]:
    """|generator - trainer| log-prob over real completion tokens, from the pre-update old log-probs."""
    total, count, worst = 0.0, 0.0, 0.0
    for mb in micro_batches:
        mask = mb.sequence_mask  # [B, C]
        diff = (mb.old_logprobs - mb.gen_logprobs).abs() * mask  # [B, C]
        total, count, worst = (
            total + float(diff.sum()),
            count + float(mask.sum()),
            max(worst, float(diff.max())),
        )
    return {"rollout/logp_diff_mean": total / max(count, 1.0), "rollout/logp_diff_max": worst}


def markdown_cell(text: str, limit: int) -> str:
    """A Markdown table cell: no pipes or newlines, truncated."""
    text = text.replace("|", "\\|").replace("\n", "<br>")
    return text if len(text) <= limit else text[: limit - 1] + "…"
