"""STORPO's token rules (uncertainty, fixed) and the order of rules: positions written by hand, and properties
checked against an independent statement of the greedy choice."""

import itertools
import random

import pytest

from grpo_lightning.algorithm.branch_points import fixed_points, token_rule_points, uncertainty_points, widest_gap
from grpo_lightning.algorithm.round_metrics import RolloutStats, rollout_metrics
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.rewards.pipeline import pipeline_from_function
from grpo_lightning.types import Completion, Prompt
from grpo_lightning.variants.storpo import STORPO
from tests.helpers import StubGenerator


# ---- uncertainty --------------------------------------------------------------------------------------------
def test_uncertainty_takes_the_highest_minus_logp_tokens():
    logprobs = [-9.0, -0.1, -2.0, -0.2, -3.0, -0.05, -4.0, -0.3]  # token 0 can never be a branch point
    assert uncertainty_points(logprobs, 1, 1) == [6]
    assert uncertainty_points(logprobs, 2, 1) == [4, 6]
    assert uncertainty_points(logprobs, 3, 1) == [2, 4, 6]
    assert uncertainty_points(logprobs, 4, 1) == [2, 4, 6, 7]  # -0.3 is the next highest
    # with a gap of 3: 6, then 4 is too close (2 apart), 2 is 4 apart: taken; then 7, 3, 1 too close to one
    assert uncertainty_points(logprobs, 2, 3) == [2, 6]


def test_uncertainty_ties_go_to_the_earlier_token():
    assert uncertainty_points([0.0, -1.0, -1.0, -1.0, -1.0], 2, 1) == [1, 2]
    assert uncertainty_points([0.0, -1.0, -1.0, -1.0, -1.0], 2, 2) == [1, 3]


def test_uncertainty_keeps_the_gap_whenever_the_points_fit():
    # 6 tokens, 4 points: candidates 1..5, and 4 points 4 apart cannot fit; the widest that can is (6-2)//3 = 1
    assert uncertainty_points([0.0, -5.0, -4.0, -3.0, -2.0, -1.0], 4, 4) == [1, 2, 3, 4]
    # 9 tokens, 2 points, gap 4: the top token (5) leaves 1 as the only point 4 away
    assert uncertainty_points([0.0, -1.0, -2.0, -3.0, -6.0, -9.0, -5.0, -4.0, -0.5], 2, 4) == [1, 5]
    # 7 tokens, 3 points, gap 3: (7-2)//2 = 2 is the widest that fits; 3 first, 2 and 4 are 1 away: skipped,
    # then 6 (-0.3), 5 is 1 from 6: skipped, 1 is 2 from 3: taken
    assert uncertainty_points([0.0, -0.1, -8.0, -9.0, -7.0, -0.2, -0.3], 3, 3) == [1, 3, 6]
    # 5 tokens, 2 points, gap 3: only 1 and 4 are 3 apart, so the top token (2) would leave no room for a second
    # point: the gap is kept and the placement is {1, 4}
    assert uncertainty_points([0.0, -1.0, -5.0, -2.0, -0.5], 2, 3) == [1, 4]
    # 16 tokens, 4 points, gap 4: 9 and 15 first; 2 (third by -log p) would leave no room for a fourth point 4
    # away from all three, so it is passed over and the gap kept (a plain greedy pass shrank it: [2, 9, 12, 15])
    logprobs = [0.0, -1, -7, -1, -1, -1, -1, -1, -1, -9, -1, -1, -1, -1, -1, -8]
    assert uncertainty_points(logprobs, 4, 4) == [1, 5, 9, 15]
    # 8 tokens, 4 points, gap 2: 1, 3, 5, 7 is the only placement
    assert uncertainty_points([0.0, -3.0, -2.5, -2.0, -0.1, -1.0, -0.2, -0.3], 4, 2) == [1, 3, 5, 7]


def _brute_force_points(logprobs, count, min_gap):
    """The placement by enumeration: of every set of min(count, L - 1) points in 1..L-1, those whose closest pair is
    the widest gap up to `min_gap` that any set reaches, and of those the one whose points rank highest (ranks by
    -log p, ties to the earlier token), compared as sorted rank lists."""
    length = len(logprobs)
    n = min(count, length - 1)
    rank = {k: r for r, k in enumerate(sorted(range(1, length), key=lambda k: (logprobs[k], k)))}
    placements = list(itertools.combinations(range(1, length), n))
    closest = {p: min((b - a for a, b in zip(p, p[1:], strict=False)), default=min_gap) for p in placements}
    gap = min(min_gap, max(closest.values()))
    kept = [p for p in placements if closest[p] >= gap]
    return list(min(kept, key=lambda p: sorted(rank[k] for k in p))), gap


@pytest.mark.parametrize("length", range(2, 41))
def test_uncertainty_points_are_the_brute_force_placement(length):
    rng = random.Random(length)
    for count in (1, 2, 3, 4) if length <= 30 else (rng.randint(1, 4),):
        min_gap = rng.randint(1, 10)
        logprobs = [-round(rng.expovariate(1.0), 1) for _ in range(length)]  # rounded: ties happen
        expected, gap = _brute_force_points(logprobs, count, min_gap)
        picked = uncertainty_points(logprobs, count, min_gap)
        assert picked == expected, (logprobs, count, min_gap, gap)
        assert widest_gap(length, count, min_gap) == gap


def test_short_completions():
    assert uncertainty_points([], 4, 2) == [] and fixed_points(0, 4) == []
    assert uncertainty_points([-1.0], 4, 2) == [] and fixed_points(1, 4) == []  # one token: nothing inside it
    assert uncertainty_points([-1.0, -0.5], 4, 8) == [1] and fixed_points(2, 4) == [1]


# ---- fixed ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "count", "expected"),
    [(48, 4, [9, 19, 28, 38]), (5, 4, [1, 2, 3, 4]), (10, 1, [5]), (3, 4, [1, 2]), (12, 3, [3, 6, 9])],
)
def test_fixed_points_by_hand(length, count, expected):
    assert fixed_points(length, count) == expected


@pytest.mark.parametrize("length", range(2, 60))
def test_fixed_points_are_distinct_and_inside(length):
    for count in range(1, 9):
        ks = fixed_points(length, count)
        assert len(ks) == min(count, length - 1) and ks == sorted(set(ks)) and ks[0] >= 1 and ks[-1] <= length - 1


def test_token_rule_points_refuses_a_text_rule():
    with pytest.raises(ValueError, match="not a token rule"):
        token_rule_points("sentence", [-1.0, -1.0], 2, 1)


# ---- STORPO with the rules ------------------------------------------------------------------------------------
class LogprobEngine(StubGenerator):
    """An engine that answers each prompt with its scripted token ids and log-probs, and each branch prefix with
    a fixed continuation; it records every request and counts every token it returns."""

    def __init__(self, initial: dict[int, tuple[list[int], list[float]]], continuation: list[int], budget: int = 32):
        super().__init__(SamplingConfig(max_new_tokens=budget))
        self.initial, self.continuation = initial, continuation
        self.calls: list[tuple[list[list[int]], int]] = []
        self.tokens_returned = 0

    def generate(self, prefixes, num_samples, max_new_tokens=None):
        self.calls.append((prefixes, num_samples))
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [self.sampling.max_new_tokens] * len(prefixes)
        out = []
        for prefix, budget in zip(prefixes, budgets, strict=True):
            if len(prefix) == 1:
                ids, logprobs = self.initial[prefix[0]]
            else:
                ids, logprobs = self.continuation[:budget], [-0.5] * len(self.continuation[:budget])
            group = [Completion(list(ids), list(logprobs), finished=True) for _ in range(num_samples)]
            self.tokens_returned += sum(len(c.token_ids) for c in group)
            out.append(group)
        return out


def _prompts(n):
    return [Prompt(prompt_ids=[1000 + i], answer="9", question=f"q{i}", problem_index=i) for i in range(n)]


def _decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)  # no periods, no lines: no text rule ever splits it


def _reward():
    return pipeline_from_function(lambda text, answer: float(text.endswith("z")))


LOGPROBS = [-0.1, -0.2, -3.0, -0.1, -0.1, -2.0, -0.1, -0.1, -0.1, -1.0]  # uncertain at 2, 5, 9


def test_uncertainty_branches_every_completion_at_its_uncertain_tokens():
    engine = LogprobEngine(
        {1000: (list(range(10)), LOGPROBS), 1001: ([3, 4], [-0.1, -0.2]), 1002: ([7], [-0.3])}, continuation=[25]
    )
    variant = STORPO(
        trees=1, completions_per_step=2, max_steps=3, min_gap=2, fallback_generations=3, step_rule="uncertainty"
    )
    rollouts = variant.generate_rollouts(engine, _prompts(3), _reward(), _decode)
    points = {g: sorted({r.branch_point for r in rollouts if r.group_id == g and r.branch_point}) for g in range(3)}
    assert points == {0: [2, 5, 9], 1: [1], 2: []}  # 10 tokens: 3 points; 2 tokens: 1; 1 token: none (plain)
    prefixes, samples = engine.calls[1]
    assert samples == 2 and prefixes == [[1000, 0, 1], [1000, *range(5)], [1000, *range(9)], [1001, 3]]
    assert len([r for r in rollouts if r.group_id == 2]) == 3  # the one-token completion's prompt: a plain group
    assert variant.metrics["rollout/storpo_branched_frac"] == pytest.approx(2 / 3)
    assert variant.metrics["rollout/storpo_fallback_frac"] == pytest.approx(1 / 3)
    assert variant.metrics["rollout/storpo_branches_mean"] == pytest.approx((3 + 1 + 0) / 3)
    assert variant.metrics["rollout/storpo_token_rule_frac"] == pytest.approx(2 / 3)


def test_tokens_generated_counts_a_shared_prefix_once():
    engine = LogprobEngine({1000: (list(range(10)), LOGPROBS), 1001: ([3, 4, 5, 6], [-1.0] * 4)}, [25, 24])
    variant = STORPO(trees=1, completions_per_step=2, max_steps=3, min_gap=1, step_rule="fixed")
    rollouts = variant.generate_rollouts(engine, _prompts(2), _reward(), _decode)
    metrics = rollout_metrics([RolloutStats.of(r) for r in rollouts], rollout_s=1.0)
    assert metrics["rollout/tokens_generated"] == engine.tokens_returned  # what the engine sampled, no more
    trained_or_not = sum(len(r.completion_ids) for r in rollouts)
    assert trained_or_not > engine.tokens_returned  # the continuations hold the shared prefixes too


def test_text_rule_first_then_the_fallback_rule_then_plain():
    listed = "a\nb\nc\nd"  # three line boundaries
    ids = [ord(ch) for ch in listed]
    decode = lambda t: "".join(chr(i) for i in t)  # noqa: E731
    plain_ids = [ord(ch) for ch in "abcdefgh"]
    engine = LogprobEngine({1000: (ids, [-1.0] * len(ids)), 1001: (plain_ids, LOGPROBS[:8])}, continuation=[122])

    def points(**kwargs):
        variant = STORPO(trees=1, completions_per_step=1, max_steps=4, min_steps=2, fallback_generations=2, **kwargs)
        rollouts = variant.generate_rollouts(engine, _prompts(2), _reward(), decode)
        return [sorted({r.branch_point for r in rollouts if r.group_id == g and r.branch_point}) for g in (0, 1)]

    # the lines give the first prompt its points; the second has none and falls to the token rule: the 4 most
    # uncertain of tokens 1..7 (-3.0 at 2, -2.0 at 5, -0.2 at 1, then the earliest -0.1, at 3) ...
    assert points(step_rule="line", fallback_rule="uncertainty", min_gap=1) == [[2, 4, 6], [1, 2, 3, 5]]
    assert points(step_rule="line", fallback_rule="fixed") == [[2, 4, 6], fixed_points(8, 4)]
    # ... or, with none, is sampled plainly
    assert points(step_rule="line", fallback_rule="none") == [[2, 4, 6], []]
    # a token rule as step_rule ignores the text
    assert points(step_rule="fixed") == [fixed_points(len(ids), 4), fixed_points(8, 4)]


def test_new_keys_are_checked_by_name():
    for kwargs, key in [
        ({"step_rule": "tokens"}, "variant.step_rule"),
        ({"fallback_rule": "sentence"}, "variant.fallback_rule"),
        ({"min_gap": 0}, "variant.min_gap"),
        ({"advantage": "vine"}, "variant.advantage"),
    ]:
        with pytest.raises(ValueError, match=key):
            STORPO(**kwargs)
