"""Dynamic sampling: keep only advantage groups whose rewards differ, drawing fresh prompts to fill the round.

A group whose completions all got the same reward has zero advantage for every completion, so it adds nothing
to the policy gradient (only the KL term, when beta > 0) while it costs a full generation. DAPO (Yu et al.
2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", section 3.2) over-samples and drops
such groups until the batch holds only informative ones; verl calls the same switch `filter_groups`.

Here a round still trains on `data.prompts_per_round` groups. The rollout loop samples a batch of that
many prompts, keeps the informative groups, and samples further batches of fresh prompts (the next positions
of the prompt stream, see `RolloutDataModule.problem_indices`) until the round is full or
`max_extra_batches` extra batches were drawn. A round that is still short is filled with dropped groups (zero
advantage), so every round has the same shape and the same optimizer steps; `rollout/ds_groups_short` counts
them. Prompts consumed by extra batches are not served again in this data pass, as in verl.

Advantages are computed after the selection, over the round's final groups (`GRPOVariant.assign_advantages`),
so batch-level reward scaling sees the batch that is trained on.

Pure: imports neither Lightning nor Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_lightning.schema import boolean, check_settings, integer, setting
from grpo_lightning.types import Rollout


@dataclass(frozen=True)
class DynamicSampling:
    """`data.dynamic_sampling`: the switch and the cap on extra generation batches per round."""

    enabled: bool = setting(True, boolean)
    max_extra_batches: int = setting(1, integer(0))

    def __post_init__(self) -> None:
        check_settings(self, "data.dynamic_sampling")


def is_informative(group: list[Rollout]) -> bool:
    """True when the group's rewards are not all equal (some completion gets a non-zero advantage)."""
    rewards = [r.reward for r in group]
    return max(rewards) > min(rewards)


def groups_in_order(rollouts: list[Rollout], num_groups: int) -> list[list[Rollout]]:
    """The rollouts of group 0, 1, ..., num_groups - 1 (a variant numbers groups by prompt index)."""
    groups: list[list[Rollout]] = [[] for _ in range(num_groups)]
    for r in rollouts:
        groups[r.group_id].append(r)
    return groups


def renumbered(groups: list[list[Rollout]]) -> list[Rollout]:
    """The groups' rollouts flattened, group ids rewritten to 0, 1, ... in the given order."""
    out = []
    for group_id, group in enumerate(groups):
        for r in group:
            r.group_id = group_id
            out.append(r)
    return out
