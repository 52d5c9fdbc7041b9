"""Sampling one round: the variant's rollouts of the round's prompts, with dynamic sampling when it is on.

Kept apart from the rollout loop (rollout_loop.py) because it touches neither the trainer nor the module, only
an engine, the variant, the reward pipeline and the prompt stream: the loop calls it between rounds, and with
`rollout.max_staleness` >= 1 a worker thread calls it beside the trainer (training/overlap.py). So the prompt
stream position is an argument and a result here, never shared state the worker would change under the trainer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from grpo_lightning.algorithm.dynamic_sampling import groups_in_order, is_informative, renumbered
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.distributed import gather_objects, rank_and_world, shard
from grpo_lightning.types import Prompt, Rollout


@dataclass
class SampledRound:
    """One round as sampled, before it is laid out: what `sample` hands `finish` (from the worker, with overlap)."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    """The round's rollouts, with advantages (group ids 0..n-1)."""
    sampled: list[Rollout]
    """Every rollout sampled on the way (dynamic sampling's dropped groups too), for the round's reward metrics."""
    sampling_metrics: dict[str, float]
    variant_metrics: dict[str, float]
    reward_errors: int
    rollout_s: float
    prompt_cursor: int
    """The prompt stream position after this round (dynamic sampling)."""


class RoundSampler:
    """What sampling a round needs: the variant, the reward pipeline, the prompts and the tokenizer."""

    def __init__(self, variant, reward_fn, datamodule: RolloutDataModule, tokenizer) -> None:
        self.variant = variant
        self.reward_fn = reward_fn
        self.datamodule = datamodule
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sample(self, engine, round_index: int, cursor: int, group=None) -> SampledRound:
        """The round's rollouts from `engine` (the variant, with dynamic sampling from stream position `cursor`
        when on). Touches neither the trainer nor the module: the overlap worker runs it, with its own process
        `group` for dynamic sampling's collective."""
        rank, world_size = rank_and_world()
        start = time.perf_counter()
        self.variant.begin_round(round_index)
        if self.datamodule.dynamic_sampling.enabled:
            prompts, rollouts, sampled, metrics, cursor = self.sample_informative(
                engine, cursor, rank, world_size, group
            )
        else:
            prompts = shard(self.datamodule.prompts_for_round(round_index, self.tokenizer), rank, world_size)
            rollouts = self.variant.generate_rollouts(engine, prompts, self.reward_fn, self.decode)
            sampled, metrics = rollouts, {}
        variant_metrics, errors = dict(self.variant.metrics), self.reward_fn.pop_errors()  # failing reward term calls
        return SampledRound(
            prompts, rollouts, sampled, metrics, variant_metrics, errors, time.perf_counter() - start, cursor
        )

    def sample_informative(self, engine, cursor: int, rank: int, world_size: int, group=None):
        """Dynamic sampling (algorithm/dynamic_sampling.py): batches of fresh prompts from stream position
        `cursor` until this round has `prompts_per_round` groups whose rewards differ, or the cap on extra batches
        is reached.

        Every rank draws the same number of batches (the stop decision is taken over all ranks, in `group`), each
        from its block of the same stream positions. Returns the round's prompts and rollouts (group ids 0..n-1,
        with advantages), every rollout sampled on the way (for the round's reward metrics), the sampling metrics
        and the stream position after the round.
        """
        per_round = self.datamodule.settings.prompts_per_round
        needed = per_round // world_size
        kept: list[tuple[Prompt, list[Rollout]]] = []
        dropped: list[tuple[Prompt, list[Rollout]]] = []
        sampled: list[Rollout] = []
        batches = 0
        while True:
            prompts = shard(self.datamodule.prompts_at(cursor, per_round, self.tokenizer), rank, world_size)
            cursor += per_round
            batches += 1
            rollouts = self.variant.sample_rollouts(engine, prompts, self.reward_fn, self.decode)
            sampled.extend(dataclasses.replace(r, group_id=r.group_id + (batches - 1) * len(prompts)) for r in rollouts)
            for prompt, group_rollouts in zip(prompts, groups_in_order(rollouts, len(prompts)), strict=True):
                (kept if is_informative(group_rollouts) else dropped).append((prompt, group_rollouts))
            still_short = max(gather_objects(needed - len(kept), group))
            if still_short <= 0 or batches > self.datamodule.dynamic_sampling.max_extra_batches:
                break
        chosen = kept[:needed] + dropped[: max(0, needed - len(kept))]
        rollouts = renumbered([g for _, g in chosen])
        self.variant.assign_advantages(rollouts, self.reward_fn)
        metrics = {
            "rollout/ds_groups_filtered": float(len(dropped)),
            "rollout/ds_groups_short": float(max(0, needed - len(kept))),
            "rollout/ds_extra_batches": float(batches - 1),
            "rollout/ds_prompts_consumed": float(batches * len(prompts)),
        }
        return [prompt for prompt, _ in chosen], rollouts, sampled, metrics, cursor
