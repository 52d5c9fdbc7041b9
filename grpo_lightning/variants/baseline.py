"""Baseline GRPO (DeepSeekMath, Shao et al. 2024): G independent completions per prompt, one group each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_lightning.schema import check_settings, integer, setting
from grpo_lightning.types import Rollout
from grpo_lightning.variants.base import GroupShape, GRPOVariant, register_variant

if TYPE_CHECKING:
    from grpo_lightning.rewards.pipeline import RewardPipeline


@dataclass(frozen=True)
class GRPOSettings:
    """`variant=grpo`: the group size G (TRL's `num_generations`), owned here: the engine samples what it is asked."""

    num_generations: int = setting(8, integer(2))

    def __post_init__(self) -> None:
        check_settings(self, "variant")


@register_variant("grpo")
class BaselineGRPO(GRPOVariant):
    settings_types = (GRPOSettings,)

    def group(self, source=None) -> GroupShape:
        """G independent completions of the prompt."""
        g = self.settings.num_generations
        return GroupShape(
            rollouts=g,
            samples=f"{g} completions",
            keys=("variant.num_generations",),
            samples_per_prefix=g,
            shared_prompt=True,
        )

    def sample_rollouts(
        self, generator, prompts: Sequence, reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        samples = generator.generate([p.prompt_ids for p in prompts], self.settings.num_generations)
        rollouts = [
            self.make_rollout(prompt, c, group_id, reward_fn, decode)
            for group_id, (prompt, completions) in enumerate(zip(prompts, samples, strict=True))
            for c in completions
        ]
        return rollouts
