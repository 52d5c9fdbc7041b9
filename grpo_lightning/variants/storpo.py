"""STORPO: branch continuations from points inside initial completions, and credit each segment (docs/algorithm.md).

Per prompt: sample `trees` initial completions (a forest: the prompt's advantage group); choose each one's branch
points, token counts k (0 < k < its length), by `step_rule` (algorithm/branch_points.py): a text rule (`sentence`,
`line`, `both`: reasoning-step boundaries in the decoded text, mapped to token boundaries) or a token rule
(`uncertainty`: the sampled tokens with the highest -log p, at least `min_gap` apart; `fixed`: evenly spaced),
which branches every completion of two or more tokens at min(`max_steps`, length - 1) points. A text rule that
finds fewer than `min_steps` boundaries hands the completion to `fallback_rule` (a token rule, or `none`: a prompt
none of whose trees branches is then sampled plainly, as is one whose completions have one token, with no point
inside). From each branch point, `completions_per_step` continuations are sampled from
`prompt_ids + completion_ids[:k]`. A continuation trains only on its own tokens after the branch point (the shared
prefix is the initial completion's, trained once there, and generated once: the token budget counts it once).

Credit, `advantage`: `group` puts the forest's completions in ONE flat advantage group; `tree` gives each token
the advantage of its segment, V(end) - V(start), each value estimated from samples that do not contain the segment:
the continuations at a branch point, the other trees at the root (algorithm/tree_advantages.py: VinePPO, arXiv
2410.01679; SPO-chain, arXiv 2505.23564).

Why token boundaries and never re-tokenised text: BPE merges across the cut ("dollars. Then" vs "dollars." +
" Then") give other ids than the model sampled, so the continuation would condition on a prefix the policy never
produced and the log-probs of the shared prefix would not be the initial completion's. Related work: TreeRL
(arXiv 2506.11902), TreeRPO (arXiv 2506.05183), TreePO (arXiv 2508.17445).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_lightning.algorithm.branch_points import (
    STEP_RULES,
    TEXT_RULES,
    TOKEN_RULES,
    evenly_spaced,
    split_steps,
    step_boundaries,
    token_boundaries,
    token_rule_points,
)
from grpo_lightning.algorithm.tree_advantages import forest_advantages
from grpo_lightning.schema import check_settings, choice, integer, setting
from grpo_lightning.types import Completion, Rollout
from grpo_lightning.variants.base import GroupShape, GRPOVariant, register_variant

if TYPE_CHECKING:
    from grpo_lightning.rewards.pipeline import RewardPipeline

log = logging.getLogger(__name__)

MOSTLY_PLAIN = 0.9
"""A round in which at least this share of prompts fell back to plain groups warns, once a run: STORPO is then
training on GRPO groups, which a user comparing the two would want to know before reading any curve."""
FALLBACK_RULES = ("none", *TOKEN_RULES)
ADVANTAGES = ("group", "tree")
STEPS_TEXT_RULE = "both"
"""The text rule that splits a completion into reasoning steps for `reward.step_transforms` under a token rule."""


@dataclass(frozen=True)
class STORPOSettings:
    """`variant=storpo`: where an initial completion branches, how many continuations each branch gets, and how
    the branches are credited."""

    trees: int = setting(2, integer(1))
    completions_per_step: int = setting(2, integer(1))
    min_steps: int = setting(2, integer(1))
    max_steps: int = setting(2, integer(1))
    fallback_generations: int = setting(8, integer(2))
    step_rule: str = setting(
        "uncertainty",
        choice(*STEP_RULES),
    )
    fallback_rule: str = setting(
        "uncertainty",
        choice(*FALLBACK_RULES),
    )
    min_gap: int = setting(4, integer(1))
    advantage: str = setting("tree", choice(*ADVANTAGES))

    def __post_init__(self) -> None:
        check_settings(self, "variant")

    @staticmethod
    def joint_problems(values: dict, prefix: str) -> list[str]:
        """A text rule's range of boundaries: at least `min_steps`, at most `max_steps` of them."""
        low, high = values.get("min_steps"), values.get("max_steps")
        if low is not None and high is not None and low > high:
            return [f"{prefix}.min_steps ({low}) must be <= {prefix}.max_steps ({high})"]
        return []


@register_variant("storpo")
class STORPO(GRPOVariant):
    knows_steps = True
    settings_types = (STORPOSettings,)

    def __init__(self, settings: STORPOSettings | None = None, /, **keys) -> None:
        super().__init__(settings, **keys)
        self._warned_plain = False
        self.begin_round(0)

    def group(self, source=None) -> GroupShape:
        """At most: `trees` initial completions, each with `completions_per_step` continuations at each of
        `max_steps` branch points, or a prompt sampled plainly (`fallback_generations`), whichever is larger."""
        s = self.settings
        branched = s.trees * (1 + s.completions_per_step * s.max_steps)
        return GroupShape(
            rollouts=max(branched, s.fallback_generations),
            samples=f"{s.trees} x (1 completion + {s.completions_per_step} continuations at each of up to "
            f"{s.max_steps} branch points) ({max(s.trees, s.fallback_generations)} completions when sampled plainly)",
            keys=("variant.trees", "variant.completions_per_step", "variant.max_steps", "variant.fallback_generations"),
            samples_per_prefix=max(s.trees, s.completions_per_step, s.fallback_generations - s.trees),
            shared_prompt=True,
        )

    # ---- where to branch ---------------------------------------------------------------------------------------
    def branch_points(self, completion: Completion, decode: Callable) -> tuple[list[int], str]:
        """The branch points of one initial completion (token counts, ascending) and the rule that gave them:
        `step_rule`, then for a text rule that found fewer than `min_steps` boundaries `fallback_rule`; ([], "none")
        when neither gives a point (the prompt is then sampled plainly)."""
        if self.settings.step_rule in TEXT_RULES:
            text = decode(completion.token_ids)
            ks = evenly_spaced(
                token_boundaries(completion.token_ids, step_boundaries(text, self.settings.step_rule), decode),
                self.settings.max_steps,
            )
            if len(ks) >= self.settings.min_steps:
                return ks, self.settings.step_rule
            rule = self.settings.fallback_rule
        else:
            rule = self.settings.step_rule
        if rule == "none":
            return [], "none"
        ks = token_rule_points(rule, completion.logprobs, self.settings.max_steps, self.settings.min_gap)
        return ks, (rule if ks else "none")

    def step_info(self, text: str, completion: Completion, branch_point: int, decode: Callable) -> dict:
        """The completion's reasoning steps and the step a continuation starts in (for `reward.step_transforms`):
        split by the text rule, or by `both` (sentences or lines) under a token rule."""
        rule = self.settings.step_rule if self.settings.step_rule in TEXT_RULES else STEPS_TEXT_RULE
        branch_chars = len(decode(completion.token_ids[:branch_point])) if branch_point else 0
        return {
            "steps": split_steps(text, rule),
            "branch_step": sum(start <= branch_chars for start in step_boundaries(text, rule)),
        }

    # ---- sampling ----------------------------------------------------------------------------------------------
    def sample_rollouts(
        self, generator, prompts: Sequence, reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        trees = self.settings.trees
        initial = generator.generate([p.prompt_ids for p in prompts], trees)  # initial[i][t]: tree t of prompt i
        branches: dict[tuple[int, int], list[int]] = {}  # (prompt, tree) -> branch points (token counts)
        by_token_rule = 0  # initial completions whose points came from a token rule
        for i, roots in enumerate(initial):
            for t, c in enumerate(roots):
                ks, rule = self.branch_points(c, decode)
                if ks:
                    branches[i, t] = ks
                    by_token_rule += rule in TOKEN_RULES
        fallback = [i for i in range(len(prompts)) if not any((i, t) in branches for t in range(trees))]
        samples: dict[int, list[tuple[Completion, int, int]]] = {  # prompt -> (completion, branch point, tree)
            i: [(c, 0, t) for t, c in enumerate(roots)] for i, roots in enumerate(initial)
        }
        self._branch(generator, prompts, initial, branches, samples)
        extra_plain = self.settings.fallback_generations - trees
        if fallback and extra_plain > 0:
            extra = generator.generate([prompts[i].prompt_ids for i in fallback], extra_plain)
            for i, completions in zip(fallback, extra, strict=True):
                samples[i].extend((c, 0, t) for t, c in enumerate(completions, start=trees))
        rollouts = []
        for i, prompt in enumerate(prompts):
            for c, k, t in samples[i]:
                rollouts.append(self.make_rollout(prompt, c, i, reward_fn, decode, k))
                rollouts[-1].tree = t
        self._count(len(prompts), initial, branches, len(fallback), by_token_rule, rollouts)
        self._warn_if_mostly_plain(len(fallback), len(prompts))
        return rollouts

    def _warn_if_mostly_plain(self, plain: int, total: int) -> None:
        if self._warned_plain or total == 0 or plain / total < MOSTLY_PLAIN:
            return
        self._warned_plain = True
        log.warning(
            "STORPO sampled %d of %d prompts as plain groups this round: their first completions had fewer than "
            "variant.min_steps=%d step boundaries (variant.step_rule=%s, variant.fallback_rule=%s) or a single "
            "token, so these groups are GRPO's. A token rule branches every completion of two or more tokens: "
            "variant.step_rule=uncertainty or fixed, or variant.fallback_rule=uncertainty (docs/algorithm.md); "
            "rollout/storpo_fallback_frac logs the share every round. Said once a run.",
            plain, total, self.settings.min_steps, self.settings.step_rule, self.settings.fallback_rule,
        )  # fmt: skip

    def _branch(self, generator, prompts, initial, branches: dict[tuple[int, int], list[int]], samples) -> None:
        """Sample `completions_per_step` continuations from every branch point of every tree, within the token
        budget."""
        jobs = [(i, t, k) for (i, t), ks in branches.items() for k in ks]
        if not jobs:
            return
        budget = generator.sampling.max_new_tokens
        continuations = generator.generate(
            [prompts[i].prompt_ids + initial[i][t].token_ids[:k] for i, t, k in jobs],
            self.settings.completions_per_step,
            max_new_tokens=[budget - k for _, _, k in jobs],
        )
        for (i, t, k), completions in zip(jobs, continuations, strict=True):
            samples[i].extend((_join(initial[i][t], k, c), k, t) for c in completions)

    # ---- credit ------------------------------------------------------------------------------------------------
    def assign_advantages(self, rollouts: list[Rollout], reward_fn: RewardPipeline) -> None:
        """The flat group's scalar advantages (the reward pipeline's group transforms); with `advantage=tree`,
        each branched group's tokens also get their segment's advantage (algorithm/tree_advantages.py), its root
        valued as the transforms value it (`RewardPipeline.centres_on_group`). A plain group (no continuation)
        keeps its scalars: it has no inner node to credit."""
        super().assign_advantages(rollouts, reward_fn)
        if self.settings.advantage != "tree":
            return
        groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.group_id, []).append(r)
        root_from_other_trees = reward_fn.centres_on_group()
        for members in groups.values():
            if not any(r.branch_point > 0 for r in members):
                continue
            per_token = forest_advantages(
                [r.advantage for r in members],
                [r.branch_point for r in members],
                [r.tree for r in members],
                [len(r.completion_ids) for r in members],
                root_from_other_trees,
            )
            for r, values in zip(members, per_token, strict=True):
                r.token_advantages = values

    # ---- metrics -----------------------------------------------------------------------------------------------
    def begin_round(self, round_index: int) -> None:
        """Start counting a new round: the metrics sum over every sampling call of the round (dynamic sampling
        draws several batches)."""
        super().begin_round(round_index)
        self._counts = {"prompts": 0, "trees": 0, "branched": 0, "points": 0, "plain": 0, "token_rule": 0}
        self._thirds: dict[str, list[float]] = {"early": [], "middle": [], "late": []}

    def _count(self, num_prompts: int, initial, branches, plain: int, by_token_rule: int, rollouts) -> None:
        """Per initial completion (tree): its branch points, whether it branched and by a token rule; per prompt:
        whether it was sampled plainly; the continuations' rewards by where in their tree they branched."""
        counts = self._counts
        counts["prompts"] += num_prompts
        counts["trees"] += num_prompts * self.settings.trees
        counts["branched"] += len(branches)
        counts["points"] += sum(len(ks) for ks in branches.values())
        counts["plain"] += plain
        counts["token_rule"] += by_token_rule
        for r in rollouts:
            if r.branch_point > 0:
                position = r.branch_point / max(len(initial[r.group_id][r.tree].token_ids), 1)
                name = "early" if position < 1 / 3 else "middle" if position < 2 / 3 else "late"
                self._thirds[name].append(r.reward)
        trees = max(counts["trees"], 1)
        self.metrics = {
            "rollout/storpo_branches_mean": counts["points"] / trees,
            "rollout/storpo_branched_frac": counts["branched"] / trees,
            "rollout/storpo_fallback_frac": counts["plain"] / max(counts["prompts"], 1),
            "rollout/storpo_token_rule_frac": counts["token_rule"] / trees,
        }
        for name, rewards in self._thirds.items():
            if rewards:
                self.metrics[f"rollout/storpo_reward_{name}"] = sum(rewards) / len(rewards)


def _join(initial: Completion, k: int, continuation: Completion) -> Completion:
    """The initial completion's first k tokens followed by a continuation sampled from them."""
    return Completion(
        token_ids=initial.token_ids[:k] + continuation.token_ids,
        logprobs=initial.logprobs[:k] + continuation.logprobs,
        finished=continuation.finished,
    )
