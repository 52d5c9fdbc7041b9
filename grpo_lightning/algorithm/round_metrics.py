"""A round's metrics: reward and length statistics over every rank's rollouts, and generator / trainer agreement.

Pure: imports torch and the package's data types, neither Lightning nor Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lightning.algorithm.advantages import zero_std_group_fraction
from grpo_lightning.types import Rollout, RolloutBatch


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


CREDIT_EPS = 1e-9
"""An advantage within this of 0 gives its token no credit: a zero-variance group's, or a segment whose end and start
values are equal (advantages are O(1); float rounding of equal means stays far below this)."""


def credited_tokens(rollouts: list[Rollout]) -> tuple[int, int]:
    """(trained tokens whose advantage is not 0, trained tokens) of a round's final rollouts: how much of what the
    round trains on carries a learning signal (STORPO's tree credit moves it between tokens; a flat group gives all
    of a completion's tokens its one advantage)."""
    credited = trained = 0
    for r in rollouts:
        own = len(r.completion_ids) - r.branch_point  # a continuation trains after its branch point only
        trained += own
        if r.token_advantages is None:  # one advantage for every trained token
            credited += own if abs(r.advantage) > CREDIT_EPS else 0
        else:
            credited += sum(abs(a) > CREDIT_EPS for a in r.token_advantages[r.branch_point :])
    return credited, trained


def round_metrics(per_rank: list[dict]) -> dict[str, float]:
    """Metrics of a whole round from every rank's part (stats over all rollouts; variant metrics: see
    `merge_variant_metrics`)."""
    stats = [s for part in per_rank for s in part["stats"]]
    metrics = rollout_metrics(stats, max(part["rollout_s"] for part in per_rank))  # ranks generate in parallel
    metrics.update(merge_variant_metrics([part["variant"] for part in per_rank]))
    metrics.update(merge_variant_metrics([part["engine"] for part in per_rank]))  # the engine's (servers')
    for key in per_rank[0]["sampling"]:  # dynamic sampling: counts over all ranks (extra batches: equal on all)
        values = [part["sampling"][key] for part in per_rank]
        metrics[key] = values[0] if key == "rollout/ds_extra_batches" else sum(values)
    metrics["rollout/reward_errors"] = float(sum(part["reward_errors"] for part in per_rank))
    credited, trained = (sum(part["credit"][i] for part in per_rank) for i in (0, 1))
    metrics["rollout/credited_token_frac"] = credited / max(trained, 1)
    return metrics


def merge_variant_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Every rank's variant metrics merged by name: each name any rank reports, in the order ranks first report it.

    A rank may lack a name: a variant logs a metric only for what it observed (STORPO's reward of continuations
    branched in the last third exists only where a tree branched there), so a rank without it observed nothing and
    counts as absent, not as 0. A name's value is the mean over the ranks that report it; a value every reporting
    rank gives alike is kept as it is (a metric already over all ranks, as self-play's are, is that value, not a
    float mean that may round away from it). Every rank merges the same gathered parts, so every rank logs the same
    names, which `log_dict(sync_dist=True)` needs."""
    names = dict.fromkeys(name for part in per_rank for name in part)
    merged = {}
    for name in names:
        values = [part[name] for part in per_rank if name in part]
        merged[name] = values[0] if all(v == values[0] for v in values) else sum(values) / len(values)
    return merged


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
        "rollout/tokens_generated": float(generated),
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


class LogpAgreement:
    """|generator - trainer| log-prob over a round's real completion tokens, before the round's first update.

    One measure, fed from whichever pass has the pre-update log-probs: the scoring pass when several optimizer
    steps consume the round, else each micro-batch's own forward (the round is one step, so every micro-batch is
    scored before the update). The stale-weight guard (generation/stale_guard.py) reads the mean.
    """

    def __init__(self) -> None:
        self.total, self.count, self.worst = 0.0, 0.0, 0.0

    def add(self, old_logprobs: Tensor, batch: RolloutBatch) -> None:  # old_logprobs [B, C]
        mask = batch.sequence_mask  # [B, C]
        diff = (old_logprobs.float() - batch.gen_logprobs).abs() * mask  # [B, C]
        self.total += float(diff.sum())
        self.count += float(mask.sum())
        self.worst = max(self.worst, float(diff.max()))

    def metrics(self) -> dict[str, float]:
        """This rank's share (the loop logs it averaged over ranks, the max as a max)."""
        return {"rollout/logp_diff_mean": self.total / max(self.count, 1.0), "rollout/logp_diff_max": self.worst}


def markdown_cell(text: str, limit: int) -> str:
    """A Markdown table cell: no pipes or newlines, truncated."""
    text = text.replace("|", "\\|").replace("\n", "<br>")
    return text if len(text) <= limit else text[: limit - 1] + "…"
