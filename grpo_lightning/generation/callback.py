"""RolloutCallback: produces each round's rollouts and logs what they look like.

Lightning builds the epoch's data loader BEFORE `on_train_epoch_start` (and, for epoch 0, even before
`on_train_start`), so round 0 is produced in `on_fit_start` and round k+1 in `on_train_epoch_end` of round k;
the trainer runs with `reload_dataloaders_every_n_epochs=1`.
"""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from grpo_lightning.advantages import zero_std_group_fraction
from grpo_lightning.data.datamodule import Prompt, RolloutDataModule
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
    ) -> None:
        self.generator = generator
        self.variant = variant
        self.reward_fn = reward_fn
        self.datamodule = datamodule
        self.decode = decode
        self.samples_every_n_rounds = samples_every_n_rounds
        self.num_samples_logged = num_samples_logged
        self.round_metrics: dict[str, float] = {}
        self._train_start = 0.0

    # ---- hooks ---------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.produce(trainer, pl_module, trainer.current_epoch)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log_dict(self.round_metrics, on_step=False, on_epoch=True, batch_size=1)
        pl_module.log("reward", self.round_metrics["train/reward_mean"], prog_bar=True, logger=False, batch_size=1)
        self._train_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("time/train_s", time.perf_counter() - self._train_start, on_epoch=True, batch_size=1)
        next_round = trainer.current_epoch + 1
        if trainer.max_epochs is None or next_round < trainer.max_epochs:
            self.produce(trainer, pl_module, next_round)

    # ---- one round -----------------------------------------------------------------------------------------
    def produce(self, trainer: L.Trainer, pl_module: L.LightningModule, round_index: int) -> None:
        self.generator.sync_weights(pl_module.policy)
        prompts = self.datamodule.prompts_for_round(round_index)
        start = time.perf_counter()
        rollouts = self.variant.generate_rollouts(self.generator, prompts, self.reward_fn, self.decode)
        rollout_s = time.perf_counter() - start
        micro_batches = self.datamodule.micro_batches_per_round * self.datamodule.num_iterations
        several_steps = micro_batches > trainer.accumulate_grad_batches  # more than one optimizer step this round
        scorer = (lambda mb: pl_module.score_old_logprobs(mb.to(pl_module.device))) if several_steps else None
        self.datamodule.set_rollouts(rollouts, round_index, trainer.accumulate_grad_batches, scorer)
        self.round_metrics = rollout_metrics(rollouts, rollout_s) | self.variant.metrics
        if several_steps:
            self.round_metrics.update(logp_diff(self.datamodule.micro_batches))
        log.info(
            "round %d: reward %.3f, %d rollouts in %.1f s",
            round_index,
            self.round_metrics["train/reward_mean"],
            len(rollouts),
            rollout_s,
        )
        if trainer.is_global_zero and round_index % self.samples_every_n_rounds == 0:
            self.log_samples(trainer, prompts, rollouts)

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


def rollout_metrics(rollouts: list[Rollout], rollout_s: float) -> dict[str, float]:
    """Round-level metrics (TRL meanings): reward stats, zero-std groups, completion lengths, throughput."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)  # [N]
    group_ids = torch.tensor([r.group_id for r in rollouts], dtype=torch.long)  # [N]
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)  # [N]
    generated = sum(len(r.completion_ids) - r.branch_point for r in rollouts)  # a branched prefix is not resampled
    num_groups = len(set(group_ids.tolist()))
    return {
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()) if len(rollouts) > 1 else 0.0,
        "train/frac_zero_std_groups": zero_std_group_fraction(rewards, group_ids),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(r.truncated for r in rollouts) / len(rollouts),
        "rollout/format_rate": sum(r.answer_extracted for r in rollouts) / len(rollouts),
        "rollout/group_size_mean": len(rollouts) / num_groups,
        "rollout/tokens_generated_per_prompt": generated / num_groups,
        "rollout/tokens_per_s": generated / max(rollout_s, 1e-9),
        "time/rollout_s": rollout_s,
    }


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
