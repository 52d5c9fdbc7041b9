"""The variant interface and its registry.

A variant decides how rollouts are sampled and grouped; the loss and the training step are shared. To add
one: subclass `GRPOVariant`, implement `sample_rollouts` (one advantage group per prompt), decorate it with
`@register_variant("name")`, and point `variant._target_` at it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from grpo_lightning.types import Rollout

if TYPE_CHECKING:
    from grpo_lightning.generation.base import Generator
    from grpo_lightning.rewards.pipeline import RewardPipeline
    from grpo_lightning.types import Completion, Prompt

VARIANTS: dict[str, type[GRPOVariant]] = {}


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
    knows_steps: bool = False
    """Whether the variant tells the reward its completions' reasoning steps (`step_info`, reward.step_transforms)."""

    metrics: dict[str, float]
    """Variant-specific metrics of the last round (logged under `rollout/`); empty by default."""

    def __init__(self) -> None:
        self.metrics = {}

    def bind_data(self, source, tokenizer, max_prompt_tokens: int) -> None:  # noqa: B027 - a no-op default
        """Take the run's data source (`data.dataset`), tokenizer and `data.max_prompt_tokens` before the first
        round (train.py): a prompt the variant builds keeps its last `max_prompt_tokens` tokens, as the data
        module's do. No-op: a variant that samples the prompts it is given needs none of them; self-play builds its
        prompts from games."""

    def begin_round(self, round_index: int) -> None:
        """Called before round `round_index`'s first sampling call (dynamic sampling may make several): `metrics`
        then describe the whole round."""
        self.metrics = {}

    def generate_rollouts(
        self, generator: Generator, prompts: Sequence[Prompt], reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        """Sample and score completions of `prompts`, then fill in every rollout's `advantage`."""
        rollouts = self.sample_rollouts(generator, prompts, reward_fn, decode)
        self.assign_advantages(rollouts, reward_fn)
        return rollouts

    @abstractmethod
    def sample_rollouts(
        self, generator: Generator, prompts: Sequence[Prompt], reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        """Sample, score and group completions (group id = index of the prompt in `prompts`); no advantages yet.

        Kept apart from `assign_advantages` so that dynamic sampling can drop groups and draw more before the
        advantages of the round's final groups are computed.
        """

    def rollouts_per_round(self, num_prompts: int) -> int:
        """How many rollouts a round of `num_prompts` prompts yields (for the dry-run plan)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a resumed run needs to sample on as this run would have (self-play: the opponent pool); saved with
        the rollout loop's state in every checkpoint. Empty: the variant keeps no state between rounds."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; a variant without state refuses a non-empty one (a checkpoint of another variant)."""
        if state:
            raise ValueError(
                f"ckpt_path: the checkpoint holds variant state ({', '.join(sorted(state))}) that variant "
                f"{self.name!r} does not keep; resume with the same variant"
            )

    def step_info(self, text: str, completion: Completion, branch_point: int, decode: Callable) -> dict:
        """What a variant that knows reasoning steps tells the reward: `steps` and `branch_step` (none here)."""
        return {}

    def make_rollout(
        self,
        prompt: Prompt,
        completion: Completion,
        group_id: int,
        reward_fn: RewardPipeline,
        decode: Callable,
        branch_point: int = 0,
    ) -> Rollout:
        """Decode and score one completion of `prompt`; `branch_point` leading tokens are not trained on."""
        text = decode(completion.token_ids)
        step_info = self.step_info(text, completion, branch_point, decode)
        return self.scored_rollout(
            prompt.prompt_ids, completion, text, prompt.answer, group_id, reward_fn, branch_point,
            record=prompt.record, **step_info,
        )  # fmt: skip

    @staticmethod
    def scored_rollout(
        prompt_ids: Sequence[int],
        completion: Completion,
        text: str,
        reference: str,
        group_id: int,
        reward_fn: RewardPipeline,
        branch_point: int = 0,
        **info,
    ) -> Rollout:
        """The Rollout of `completion`, sampled from `prompt_ids`, scored on `text` (the completion as the reward
        reads it: self-play's includes the reply prefix) against `reference`; `info` goes to the reward terms
        beside `truncated`, `num_tokens` and `branch_point`."""
        result = reward_fn.score_completion(
            text, reference, truncated=not completion.finished, num_tokens=len(completion.token_ids),
            branch_point=branch_point, **info,
        )  # fmt: skip
        return Rollout(
            prompt_ids=list(prompt_ids),
            completion_ids=completion.token_ids,
            gen_logprobs=completion.logprobs,
            reward=result.reward,
            group_id=group_id,
            truncated=not completion.finished,
            text=text,
            branch_point=branch_point,
            answer_extracted=result.extracted is not None,
            reward_terms=dict(result.terms or {}),
        )

    def assign_advantages(self, rollouts: list[Rollout], reward_fn: RewardPipeline) -> None:
        """Fill `advantage` as in docs/algorithm.md (Advantages) over the rollouts' group ids: the reward
        pipeline's group transforms (`reward.group_transforms`, docs/rewards.md)."""
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        group_ids = torch.tensor([r.group_id for r in rollouts], dtype=torch.long)
        advantages = reward_fn.advantages(rewards, group_ids)
        for r, a in zip(rollouts, advantages.tolist(), strict=True):
            r.advantage = a
