"""STORPO: branch continuations from the reasoning-step boundaries of one initial completion (docs/algorithm.md).

Per prompt: sample ONE completion; find step boundaries in its decoded text by `step_rule` (docs/algorithm.md:
`sentence`, a period not after a digit, whitespace, then a capital or a digit; `line`, the start of each
non-empty line after the first; `both`, either); map each to a TOKEN boundary k of that
completion; sample `completions_per_step` continuations from `prompt_ids + completion_ids[:k]`. The initial
completion and all its continuations form ONE advantage group. A continuation trains only on its own tokens
after the branch point (the shared prefix is the initial completion's, trained once there).

Why token boundaries and never re-tokenised text: BPE merges across the cut ("dollars. Then" vs "dollars." +
" Then") give other ids than the model sampled, so the continuation would condition on a prefix the policy never
produced and the log-probs of the shared prefix would not be the initial completion's. The largest k whose
decoded prefix fits inside the character boundary is used, so the prefix is exactly the first k sampled ids.

Prompts with fewer than `min_steps` boundaries fall back to plain GRPO sampling (`fallback_generations`
independent completions, the initial one included) and are counted. Related work: SPO-chain (arXiv 2505.23564),
TreeRPO (arXiv 2506.05183), TreePO (arXiv 2508.17445).
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_lightning.schema import check_settings, choice, configures, integer, setting
from grpo_lightning.types import Completion, Rollout
from grpo_lightning.variants.base import GRPOVariant, register_variant

if TYPE_CHECKING:
    from grpo_lightning.rewards.pipeline import RewardPipeline

log = logging.getLogger(__name__)

MOSTLY_PLAIN = 0.9
"""A round in which at least this share of prompts fell back to plain groups warns, once a run: STORPO is then
training on GRPO groups, which a user comparing the two would want to know before reading any curve."""

STEP_BOUNDARY = re.compile(r"(?<![0-9])\.(?:\s+|\n+)(?=[A-Z0-9])")
"""A sentence that ends a step: a period not after a digit ("$1.50. Then" never splits), whitespace, then a
capital or a digit."""
LINE_BOUNDARY = re.compile(r"\n\s*(?=\S)")
"""A line that ends a step: a line break, then (after any blank lines and indentation) the next line's text. Small
models often write their steps as lines (`1. Multiply 5 by 3`), which the sentence rule never splits."""
STEP_RULES = {"sentence": (STEP_BOUNDARY,), "line": (LINE_BOUNDARY,), "both": (STEP_BOUNDARY, LINE_BOUNDARY)}
"""`variant.step_rule`: the patterns whose match ends mark where a new step starts."""


def step_boundaries(text: str, rule: str = "sentence") -> list[int]:
    """Character offsets where a new reasoning step starts, ascending: the ends of the `rule`'s matches (`both`:
    either rule's, once each). Every pattern looks ahead for the next step's text, so none is at the very end."""
    return sorted({m.end() for pattern in STEP_RULES[rule] for m in pattern.finditer(text)})


def token_boundaries(token_ids: Sequence[int], char_offsets: Sequence[int], decode: Callable) -> list[int]:
    """Map character offsets of decode(token_ids) to token counts k (0 < k < len(token_ids)), deduplicated.

    k is the largest prefix length whose decoded text is no longer than the offset, so the prefix ends at or
    before the boundary (a token like " Then" that straddles it goes to the continuation).
    """
    lengths, longest = [], 0
    for k in range(len(token_ids) + 1):
        longest = max(longest, len(decode(list(token_ids[:k]))))  # running max: decoded lengths never shrink
        lengths.append(longest)
    ks = []
    for offset in char_offsets:
        k = bisect.bisect_right(lengths, offset) - 1
        if 0 < k < len(token_ids) and k not in ks:
            ks.append(k)
    return ks


def evenly_spaced(items: Sequence[int], limit: int) -> list[int]:
    """At most `limit` items, spread evenly (the middle of each of `limit` equal slices)."""
    n = len(items)
    if n <= limit:
        return list(items)
    return [items[int((j + 0.5) * n / limit)] for j in range(limit)]


def split_steps(text: str, rule: str = "sentence") -> list[str]:
    """The reasoning steps of `text`: the pieces between consecutive step boundaries (they join back to it)."""
    cuts = [0, *step_boundaries(text, rule), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


@dataclass(frozen=True)
class STORPOSettings:
    """`variant=storpo`: where an initial completion branches and how many continuations each branch gets."""

    completions_per_step: int = setting(2, integer(1), "continuations sampled from each branch point")
    min_steps: int = setting(2, integer(1), "a completion with fewer reasoning steps is sampled plainly instead")
    max_steps: int = setting(4, integer(1), "at most this many branch points, evenly spaced")
    fallback_generations: int = setting(
        4, integer(2), "group size of a prompt sampled plainly (generator.num_generations by default)"
    )
    step_rule: str = setting(
        "sentence", choice(*STEP_RULES), "where a step ends: sentence | line | both (docs/algorithm.md)"
    )

    def __post_init__(self) -> None:
        check_settings(self, "variant")


@register_variant("storpo")
class STORPO(GRPOVariant):
    knows_steps = True

    def __init__(
        self,
        completions_per_step: int = STORPOSettings.completions_per_step,
        min_steps: int = STORPOSettings.min_steps,
        max_steps: int = STORPOSettings.max_steps,
        fallback_generations: int = STORPOSettings.fallback_generations,
        step_rule: str = STORPOSettings.step_rule,
    ) -> None:
        super().__init__()
        STORPOSettings(completions_per_step, min_steps, max_steps, fallback_generations, step_rule)
        if min_steps > max_steps:
            raise ValueError(f"variant.min_steps ({min_steps}) must be <= variant.max_steps ({max_steps})")
        self.completions_per_step = completions_per_step
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.fallback_generations = fallback_generations
        self.step_rule = step_rule
        self._warned_plain = False

    def step_info(self, text: str, completion: Completion, branch_point: int, decode: Callable) -> dict:
        """The completion's reasoning steps and the step a continuation starts in (for `reward.step_transforms`)."""
        branch_chars = len(decode(completion.token_ids[:branch_point])) if branch_point else 0
        return {
            "steps": split_steps(text, self.step_rule),
            "branch_step": sum(start <= branch_chars for start in step_boundaries(text, self.step_rule)),
        }

    def rollouts_per_round(self, num_prompts: int) -> int:
        """Upper bound: every prompt branches at max_steps boundaries."""
        return num_prompts * max(1 + self.completions_per_step * self.max_steps, self.fallback_generations)

    def sample_rollouts(
        self, generator, prompts: Sequence, reward_fn: RewardPipeline, decode: Callable
    ) -> list[Rollout]:
        initial = [group[0] for group in generator.generate([p.prompt_ids for p in prompts], 1)]
        branches: dict[int, list[int]] = {}  # prompt index -> branch points (token counts)
        fallback: list[int] = []  # prompt indices sampled plainly
        for i, c in enumerate(initial):
            ks = evenly_spaced(
                token_boundaries(c.token_ids, step_boundaries(decode(c.token_ids), self.step_rule), decode),
                self.max_steps,
            )
            if len(ks) >= self.min_steps:
                branches[i] = ks
            else:
                fallback.append(i)
        samples: dict[int, list[tuple[Completion, int]]] = {i: [(c, 0)] for i, c in enumerate(initial)}
        self._branch(generator, prompts, initial, branches, samples)
        if fallback:
            extra = generator.generate([prompts[i].prompt_ids for i in fallback], self.fallback_generations - 1)
            for i, completions in zip(fallback, extra, strict=True):
                samples[i].extend((c, 0) for c in completions)
        rollouts = [
            self.make_rollout(prompts[i], c, i, reward_fn, decode, k)
            for i in range(len(prompts))
            for c, k in samples[i]
        ]
        self.metrics = self._metrics(len(prompts), initial, branches, fallback, rollouts)
        self._warn_if_mostly_plain(len(fallback), len(prompts))
        return rollouts

    def _warn_if_mostly_plain(self, plain: int, total: int) -> None:
        if self._warned_plain or total == 0 or plain / total < MOSTLY_PLAIN:
            return
        self._warned_plain = True
        log.warning(
            "STORPO sampled %d of %d prompts as plain groups this round: their first completions had fewer than "
            "variant.min_steps=%d step boundaries (variant.step_rule=%s), so these groups are GRPO's. Try another "
            "variant.step_rule (sentence | line | both), a prompt that asks for steps, or a larger "
            "generator.max_new_tokens (docs/algorithm.md); rollout/storpo_fallback_frac logs the share every "
            "round. Said once a run.",
            plain, total, self.min_steps, self.step_rule,
        )  # fmt: skip

    def _branch(self, generator, prompts, initial: list[Completion], branches: dict[int, list[int]], samples) -> None:
        """Sample `completions_per_step` continuations from every branch point, within the token budget."""
        jobs = [(i, k) for i, ks in branches.items() for k in ks]
        if not jobs:
            return
        budget = generator.sampling.max_new_tokens
        continuations = generator.generate(
            [prompts[i].prompt_ids + initial[i].token_ids[:k] for i, k in jobs],
            self.completions_per_step,
            max_new_tokens=[budget - k for _, k in jobs],
        )
        for (i, k), completions in zip(jobs, continuations, strict=True):
            samples[i].extend((_join(initial[i], k, c), k) for c in completions)

    def _metrics(self, num_prompts: int, initial, branches, fallback, rollouts: list[Rollout]) -> dict[str, float]:
        n = max(num_prompts, 1)
        metrics = {
            "rollout/storpo_branches_mean": sum(len(ks) for ks in branches.values()) / n,
            "rollout/storpo_fallback_frac": len(fallback) / n,
        }
        thirds: dict[str, list[float]] = {"early": [], "middle": [], "late": []}
        for r in rollouts:
            if r.branch_point > 0:
                position = r.branch_point / max(len(initial[r.group_id].token_ids), 1)
                name = "early" if position < 1 / 3 else "middle" if position < 2 / 3 else "late"
                thirds[name].append(r.reward)
        for name, rewards in thirds.items():
            if rewards:
                metrics[f"rollout/storpo_reward_{name}"] = sum(rewards) / len(rewards)
        return metrics


def _join(initial: Completion, k: int, continuation: Completion) -> Completion:
    """The initial completion's first k tokens followed by a continuation sampled from them."""
    return Completion(
        token_ids=initial.token_ids[:k] + continuation.token_ids,
        logprobs=initial.logprobs[:k] + continuation.logprobs,
        finished=continuation.finished,
    )


configures(STORPO, STORPOSettings)
