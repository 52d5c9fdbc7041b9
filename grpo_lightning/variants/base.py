"""The variant interface and its registry.

A variant decides how rollouts are sampled and grouped; the loss and the training step are shared. To add
one: subclass `GRPOVariant`, decorate it with `@register_variant("name")`, and point `variant._target_` at it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from grpo_lightning.advantages import SCALE_REWARDS, group_advantages
from grpo_lightning.rewards import RewardResult
from grpo_lightning.rollouts import Rollout

if TYPE_CHECKING:
    from grpo_lightning.data.datamodule import Prompt
    from grpo_lightning.generation.base import Completion, Generator

VARIANTS: dict[str, type[GRPOVariant]] = {}

RewardFn = Callable[[str, str], float]


def register_variant(name: str):
    """Class decorator: make a variant known by name (listed by `dry_run` and docs/extending.md)."""

    def decorator(cls: type[GRPOVariant]) -> type[GRPOVariant]:
        if name in VARIANTS and VARIANTS[name] is not cls:
            raise ValueError(f"variant name {name!r} is already registered by {VARIANTS[name].__qualname__}")
        cls.name = name
        VARIANTS[name] = cls
        return cls

    return decorator


class GRPOVariant(ABC):
    """Turns a round's prompts into rollouts with rewards and advantages."""

    name: str = "unregistered"

    metrics: dict[str, float]
    """Variant-specific metrics of the last round (logged under `rollout/`); empty by default."""

    def __init__(self, scale_rewards: str = "group") -> None:
        self.metrics = {}
        if scale_rewards not in SCALE_REWARDS:
            choices = ", ".join(SCALE_REWARDS)
            raise ValueError(f"variant.scale_rewards must be one of {choices} (got {scale_rewards!r})")
        self.scale_rewards = scale_rewards

    @abstractmethod
    def generate_rollouts(
        self, generator: Generator, prompts: Sequence[Prompt], reward_fn: RewardFn, decode: Callable
    ) -> list[Rollout]:
        """Sample, score and group completions; return rollouts with `advantage` filled in."""

    def rollouts_per_round(self, num_prompts: int) -> int:
        """How many rollouts a round of `num_prompts` prompts yields (for the dry-run plan)."""
        raise NotImplementedError

    def score(self, reward_fn: RewardFn, text: str, answer: str) -> RewardResult:
        """Reward of one completion; a reward_fn with `score_detailed` also reports answer extraction."""
        detailed = getattr(reward_fn, "score_detailed", None)
        if detailed is not None:
            return detailed(text, answer)
        reward = float(reward_fn(text, answer))
        return RewardResult(reward=reward, extracted=None, correct=reward >= 1.0)

    def make_rollout(
        self, prompt: Prompt, completion: Completion, group_id: int, reward_fn: RewardFn, decode, branch_point: int = 0
    ) -> Rollout:
        """Decode and score one completion of `prompt`; `branch_point` leading tokens are not trained on."""
        text = decode(completion.token_ids)
        result = self.score(reward_fn, text, prompt.answer)
        return Rollout(
            prompt_ids=list(prompt.prompt_ids),
            completion_ids=completion.token_ids,
            gen_logprobs=completion.logprobs,
            reward=result.reward,
            group_id=group_id,
            truncated=not completion.finished,
            text=text,
            branch_point=branch_point,
            answer_extracted=result.extracted is not None,
        )

    def assign_advantages(self, rollouts: list[Rollout]) -> None:
        """Fill `advantage` as in docs/algorithm.md (Advantages) over the rollouts' group ids."""
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        group_ids = torch.tensor([r.group_id for r in rollouts], dtype=torch.long)
        for r, a in zip(rollouts, group_advantages(rewards, group_ids, self.scale_rewards).tolist(), strict=True):
            r.advantage = a
