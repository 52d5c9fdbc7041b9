"""Baseline GRPO (DeepSeekMath, Shao et al. 2024): G independent completions per prompt, one group each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from grpo_lightning.types import Rollout
from grpo_lightning.variants.base import GRPOVariant, register_variant

if TYPE_CHECKING:
    from grpo_lightning.rewards.pipeline import RewardPipeline


@register_variant("grpo")
class BaselineGRPO(GRPOVariant):
    def __init__(self, num_generations: int = 4) -> None:
        """`num_generations` is `generator.num_generations` (the group size; the generator's config checks it)."""
        super().__init__()
        self.num_generations = num_generations

    def rollouts_per_round(self, num_prompts: int) -> int:
        return num_prompts * self.num_generations

    def sample_rollouts(
        self, generator, prompts: Sequence, reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        samples = generator.generate([p.prompt_ids for p in prompts], self.num_generations)
        rollouts = [
            self.make_rollout(prompt, c, group_id, reward_fn, decode)
            for group_id, (prompt, completions) in enumerate(zip(prompts, samples, strict=True))
            for c in completions
        ]
        return rollouts
