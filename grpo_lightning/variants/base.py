"""The variant interface and its registry.

A variant decides how rollouts are sampled and grouped; the loss and the training step are shared. A variant owns
its configuration (the `variant` node: its settings dataclass in `settings_types`, its rules across nodes in
`check_config`) and says what one prompt's advantage group is (`group`), which the plan, the memory estimate,
the checkpoint's fixed settings and the model card read. To add one (docs/extending.md): subclass
`GRPOVariant`, declare its settings, implement `group` and `sample_rollouts`, decorate it with
`@register_variant("name")`, and point `variant._target_` at it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo_lightning.data.games import GameSeeds
from grpo_lightning.schema import Configured, target_class
from grpo_lightning.types import Rollout

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from grpo_lightning.generation.base import Generator
    from grpo_lightning.rewards.pipeline import RewardPipeline
    from grpo_lightning.types import Completion, Prompt

VARIANTS: dict[str, type[GRPOVariant]] = {}


def variant_name(variant: type) -> str:
    """`variant=<name>` of a variant class, or its class path when it is not a registered variant."""
    names = [name for name, cls in VARIANTS.items() if cls is variant]
    return f"variant={names[0]}" if names else f"{variant.__module__}.{variant.__qualname__}"


def register_variant(name: str):
    """Class decorator: make a variant known by name (listed by `dry_run` and docs/extending.md)."""

    def decorator(cls: type[GRPOVariant]) -> type[GRPOVariant]:
        if name in VARIANTS and VARIANTS[name] is not cls:
            raise ValueError(f"variant name {name!r} is already registered by {VARIANTS[name].__qualname__}")
        cls.name = name
        VARIANTS[name] = cls
        return cls

    return decorator


@dataclass(frozen=True)
class GroupShape:
    """One prompt's advantage group in a round, as its variant samples it."""

    rollouts: int
    """The most rollouts (trained sequences) the group can hold: the plan's rollouts per round are this times the
    prompts, and the memory estimate's micro-batch rows this times data.groups_per_micro_batch."""
    samples: str
    """How the group is sampled, in words (the model card): "8 completions", "4 games of a seed from one seat"."""
    keys: tuple[str, ...]
    """The config keys that set the group's size: named where the plan asks to lower them, and fixed on resume."""
    samples_per_prefix: int
    """The most sequences one generate call samples from one prefix (a call never splits them): the engine's
    fewest rows a call."""
    shared_prompt: bool
    """Whether every rollout of the group continues one prompt (GRPO, STORPO), so that a forward that runs a
    shared prompt once (perf.forward.share_prefix) saves its tokens; a game's turns each have their own."""


class GRPOVariant(Configured, ABC):
    """Turns a round's prompts into rollouts with rewards and advantages.

    Hydra builds it with the `variant` node's keys, which become `self.settings` (an object of its one settings
    type); a caller may pass that object instead: `STORPO(STORPOSettings(min_gap=2))` or `STORPO(min_gap=2)`.
    """

    name: str = "unregistered"
    plays_games: bool = False
    """Whether the variant's prompts are game seeds it plays (data=games) rather than questions it samples."""
    knows_steps: bool = False
    """Whether the variant tells the reward its completions' reasoning steps (`step_info`, reward.step_transforms)."""

    metrics: dict[str, float]
    """Variant-specific metrics of the last round (logged under `rollout/`); empty by default."""

    def __init__(self, settings: Any = None, /, **keys: Any) -> None:
        if settings is not None and keys:
            raise TypeError(f"{type(self).__name__} takes a settings object or its keys, not both")
        if settings is None:
            built = self.settings_from(keys)  # a key no settings type declares is refused by name
            settings = built[0] if built else None
        elif self.settings_types and not isinstance(settings, self.settings_types[0]):
            raise TypeError(f"{type(self).__name__} takes a {self.settings_types[0].__name__} (got {settings!r})")
        self.settings = settings
        self.metrics = {}

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """A variant that samples answers to questions refuses data=games, whose problems are game seeds."""
        source = target_class(cfg.data.dataset.get("_target_"))
        if not cls.plays_games and source is not None and issubclass(source, GameSeeds):
            raise ValueError(
                f"data=games is played by variant=selfplay (this run's variant is {variant_name(cls)}): add "
                "variant=selfplay reward=selfplay"
            )

    @abstractmethod
    def group(self, source: Any = None) -> GroupShape:
        """What one prompt of the data source `source` (`data.dataset`; None: any) yields in a round, its advantage
        group: from the settings, and from what the source bounds (a game's longest game)."""

    def bind_data(self, source, tokenizer, max_prompt_tokens: int) -> None:  # noqa: B027 - a no-op default
        """Take the run's data source (`data.dataset`), tokenizer and `data.max_prompt_tokens` before the first
        round (train.py): a prompt the variant builds keeps its last `max_prompt_tokens` tokens, as the data
        module's do. No-op: a variant that samples the prompts it is given needs none of them; self-play builds its
        prompts from games."""

    def bind_module(self, module) -> None:  # noqa: B027 - a no-op default
        """Take the training module (`GRPOModule`) before the first round (train.py), for a variant that reads the
        policy's probabilities outside sampling (self-play's `best_response` opponent, games/policy_moves.py
        `ScoresCompletions`). No-op: the others sample through the generator alone."""

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
