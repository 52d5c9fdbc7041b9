"""STORPO's estimator against exact expectations (docs/algorithm.md, "Credit from the branches").

A scripted engine samples binary tokens from a known chain and reports the probability of what it sampled; walking
every sequence of its coin flips runs the real variant (branch points, continuations, rewards, group transforms,
tree credit) on every outcome, so each expectation below is an exact sum, compared with values worked by hand or
brute-forced in float64 from the chain. Also: the group size a forest logs, and which transforms value the root.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from itertools import product

import pytest
import torch

from grpo_lightning.algorithm.round_metrics import RolloutStats, rollout_metrics
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.rewards.pipeline import build_reward, pipeline_from_function
from grpo_lightning.rewards.transforms import BatchNormalize, EMABaseline, GroupNormalize
from grpo_lightning.types import Completion, Rollout
from grpo_lightning.variants.storpo import STORPO
from tests.helpers import StubGenerator
from tests.unit.test_branch_points import LogprobEngine, _prompts


# ---- exact expectations over a chain of coin flips ------------------------------------------------------------------
class ChainEngine(StubGenerator):
    """Completions of `length` binary tokens, token t being 1 with probability `prob_one(t, token t - 1)` (None
    before the first). The coin flips come from `script` (0 past its end); a token of probability 0 or 1 takes
    none. `used` is the flips consumed, `probability` the product of every sampled token's probability."""

    def __init__(self, prob_one: Callable, length: int, script: list[int]) -> None:
        super().__init__(SamplingConfig(max_new_tokens=length))
        self.prob_one, self.length, self.script = prob_one, length, script
        self.used: list[int] = []
        self.probability = 1.0

    def _token(self, position: int, previous: int | None) -> tuple[int, float]:
        p = self.prob_one(position, previous)
        if p in (0.0, 1.0):
            token = int(p)
        else:
            token = self.script[len(self.used)] if len(self.used) < len(self.script) else 0
            self.used.append(token)
        q = p if token else 1.0 - p
        self.probability *= q
        return token, math.log(q)

    def generate(self, prefixes, num_samples, max_new_tokens=None):
        out = []
        for prefix in prefixes:  # the prompt is one token; the rest is the branched prefix
            group = []
            for _ in range(num_samples):
                ids, logprobs = list(prefix[1:]), []
                for position in range(len(ids), self.length):
                    token, logp = self._token(position, ids[-1] if ids else None)
                    ids.append(token)
                    logprobs.append(logp)
                group.append(Completion(ids[len(prefix) - 1 :], logprobs, finished=True))
            out.append(group)
        return out


def every_outcome(run: Callable[[list[int]], tuple[ChainEngine, list[Rollout]]]):
    """(probability, rollouts) of every outcome of `run`, a depth-first walk over its coin flips: after each run,
    the last flip that was 0 becomes 1 and the flips after it are dropped. The probabilities sum to 1."""
    script: list[int] = []
    while True:
        engine, rollouts = run(script)
        yield engine.probability, rollouts
        script = list(engine.used)
        while script and script[-1] == 1:
            script.pop()
        if not script:
            return
        script[-1] = 1


def decode(ids: list[int]) -> str:
    return "".join(str(i) for i in ids)


def storpo_runner(prob_one, length, reward_of, transform, **settings):
    """`run(script)` for `every_outcome`: one prompt through STORPO on a ChainEngine, rewarded `reward_of(tokens)`,
    its advantages from the group transform `transform`."""
    reward = pipeline_from_function(lambda text, answer: reward_of(tuple(int(c) for c in text)))
    reward.group_transforms[0].fn = transform
    variant = STORPO(advantage="tree", **settings)

    def run(script):
        engine = ChainEngine(prob_one, length, script)
        return engine, variant.generate_rollouts(engine, _prompts(1), reward, decode)

    return run


def value(prob_one, prefix: tuple[int, ...], length: int, reward_of) -> float:
    """v(prefix): the expected reward of a completion continued from `prefix`, a sum over every suffix (float64)."""
    total = 0.0
    for suffix in product((0, 1), repeat=length - len(prefix)):
        tokens, p = (*prefix, *suffix), 1.0
        for t in range(len(prefix), length):
            one = prob_one(t, tokens[t - 1] if t else None)
            p *= one if tokens[t] else 1.0 - one
        total += p * reward_of(tokens)
    return total


def coins(position, previous):
    """Bias example: token 0 is always 1, token 1 is 1 with probability 3/4, token 2 with 1/2 (independent)."""
    return (1.0, 0.75, 0.5)[position]


def token_1(tokens):
    return float(tokens[1])


@pytest.mark.parametrize(
    ("step_rule", "bias", "segment_added"),
    [
        ("fixed", 0.0, 0.0),  # the point does not depend on the sample: unbiased
        ("uncertainty", 3 / 32, 3 / 16),  # the point depends on token 1
    ],
)
def test_the_root_value_is_biased_when_the_branch_point_depends_on_the_sample(step_rule, bias, segment_added):
    """Two trees of 3 tokens, one continuation from one branch point, reward = token 1, A = r - the group mean
    (GroupNormalize, scale none: the root is valued by the other tree). The true root value v(root) = 3/4.

    `fixed` branches at k = floor(3 / 2) = 1 always: a continuation re-samples token 1, expected reward 3/4, and a
    tree's mean reward has expectation (3/4 + 3/4) / 2 = 3/4 = v(root).

    `uncertainty` branches at the sampled token of higher -log p among tokens 1 and 2: token 1 = 1 (p 3/4) is
    surer than token 2 (p 1/2), so k = 2 and the continuation keeps token 1 = 1 (reward 1); token 1 = 0 (p 1/4) is
    less sure, so k = 1 and the continuation re-samples it (expected reward 3/4). The continuation's expected
    reward is 3/4 x 1 + 1/4 x 3/4 = 15/16, a tree's mean (3/4 + 15/16) / 2 = 27/32: the other tree's mean, tree
    0's V(root), overestimates v(root) by 3/32. The first segment's credit V(b_1) - V(root) (in A's units the group
    mean cancels) then has expectation 15/16 - 27/32 = 3/32 where the value the segment added, E[v(b_1)] - v(root),
    is 15/16 - 3/4 = 3/16."""
    assert value(coins, (), 3, token_1) == pytest.approx(3 / 4, abs=1e-15)
    run = storpo_runner(
        coins, 3, token_1, GroupNormalize(scale="none"), trees=2, completions_per_step=1, min_steps=1, max_steps=1,
        step_rule=step_rule,
    )  # fmt: skip
    total = root = first = added = 0.0
    for p, rollouts in every_outcome(run):
        assert len(rollouts) == 4  # 2 trees x (1 initial + 1 continuation)
        initial = next(r for r in rollouts if r.tree == 0 and r.branch_point == 0)
        continuation = next(r for r in rollouts if r.tree == 0 and r.branch_point > 0)
        b = continuation.branch_point
        credit = initial.token_advantages[0]  # the first segment, tokens [0, b)
        assert initial.token_advantages[:b] == [credit] * b
        estimate = continuation.reward - credit  # V(root) = V(b_1) - (V(b_1) - V(root)), in reward units
        other_tree = [r.reward for r in rollouts if r.tree == 1]
        assert estimate == pytest.approx(sum(other_tree) / len(other_tree), abs=1e-6)  # the other tree's mean
        total += p
        first += p * credit
        root += p * estimate
        added += p * (value(coins, tuple(initial.completion_ids[:b]), 3, token_1) - 3 / 4)
    assert total == pytest.approx(1.0, abs=1e-12)
    assert root == pytest.approx(3 / 4 + bias, abs=1e-12)  # E[V(root)] = v(root) + the bias worked above
    assert added == pytest.approx(segment_added, abs=1e-12)
    assert first == pytest.approx(segment_added - bias, abs=1e-12)  # the credit is short by the bias


STAY = {1: 0.8, 0: 0.3}
"""A two-state chain: P(token t = 1 | token t - 1)."""


def chain(position, previous):
    return 1.0 if position == 0 else STAY[previous]


def partial_credit(tokens):
    """The chain's reward: token 3, and half a point for token 2."""
    return tokens[3] + tokens[2] / 2


def conditional_on_the_initial(transform):
    """One tree of 4 tokens (token 0 always 1, then the chain), rewarded `partial_credit`, branched by `uncertainty`
    at 2 of tokens 1..3 (min_gap 1: where the least likely tokens were, so the points depend on the whole sample),
    one continuation each. Each outcome (probability, initial rollout, continuations by branch point, and the score
    d/dtheta log p of each continuation's own tokens, theta a shift of every logit of token 1: the sum of
    token - P(token = 1)), grouped by the initial completion's tokens."""
    run = storpo_runner(
        chain, 4, partial_credit, transform,
        trees=1, completions_per_step=1, max_steps=2, step_rule="uncertainty", min_gap=1,
    )  # fmt: skip
    by_initial = defaultdict(list)
    for p, rollouts in every_outcome(run):
        initial = next(r for r in rollouts if r.branch_point == 0)
        conts = sorted((r for r in rollouts if r.branch_point > 0), key=lambda r: r.branch_point)
        scores = []
        for c in conts:
            ids = c.completion_ids
            scores.append(sum(ids[t] - STAY[ids[t - 1]] for t in range(c.branch_point, 4)))
        by_initial[tuple(initial.completion_ids)].append((p, initial, conts, scores))
    return by_initial


@pytest.mark.parametrize("transform", ["normalize_none", "ema_none"])
def test_inner_and_last_segments_are_unbiased_given_the_initial_completion(transform):
    """Given the initial completion x (and so its branch points b_1 < b_2, wherever the rule put them), the inner
    segment's credit V(b_2) - V(b_1) has expectation v(x[:b_2]) - v(x[:b_1]) and the last segment's A - V(b_2) has
    r(x) - v(x[:b_2]): the values the segments added, v brute-forced from the chain. A is the reward minus a
    baseline the group shares (GroupNormalize or EMABaseline, scale none), which cancels in both."""
    stage = GroupNormalize(scale="none") if transform == "normalize_none" else EMABaseline(decay=0.5)
    by_initial = conditional_on_the_initial(stage)
    assert len(by_initial) == 8  # every initial completion 1xyz
    points_seen = set()
    for x, outcomes in by_initial.items():
        mass = sum(p for p, *_ in outcomes)
        b1, b2 = (c.branch_point for c in outcomes[0][2])
        points_seen.add((b1, b2))
        inner = sum(p * initial.token_advantages[b1] for p, initial, _, _ in outcomes) / mass
        last = sum(p * initial.token_advantages[b2] for p, initial, _, _ in outcomes) / mass
        v1, v2 = value(chain, x[:b1], 4, partial_credit), value(chain, x[:b2], 4, partial_credit)
        assert inner == pytest.approx(v2 - v1, abs=1e-6), x
        assert last == pytest.approx(partial_credit(x) - v2, abs=1e-6), x
    assert len(points_seen) > 1  # the points do depend on the sample


def test_a_continuations_baseline_is_a_gradient_baseline_not_a_value_estimate():
    """A continuation's baseline (the tree's other completions through its branch point, itself left out) does not
    depend on its own tokens: given the initial completion, E[baseline x score] = 0 exactly, so subtracting it
    leaves the policy gradient E[A x score] as it was. As a value it is not v(b): from b_1 it averages the initial
    completion's reward r(x) and the continuation from b_2 (expected v(x[:b_2])), whose mean is not v(x[:b_1])."""
    by_initial = conditional_on_the_initial(GroupNormalize(scale="none"))
    moved = off_value = 0
    for x, outcomes in by_initial.items():
        mass = sum(p for p, *_ in outcomes)
        b1, b2 = (c.branch_point for c in outcomes[0][2])
        for j in (0, 1):
            signal = sum(p * conts[j].reward * scores[j] for p, _, conts, scores in outcomes) / mass
            own = [conts[j].token_advantages[conts[j].branch_point] for _, _, conts, _ in outcomes]
            baseline = [conts[j].reward - a for (_, _, conts, _), a in zip(outcomes, own, strict=True)]
            against = sum(p * b * s[j] for (p, _, _, s), b in zip(outcomes, baseline, strict=True)) / mass
            credited = sum(p * a * s[j] for (p, _, _, s), a in zip(outcomes, own, strict=True)) / mass
            assert against == pytest.approx(0.0, abs=1e-6), (x, j)
            assert credited == pytest.approx(signal, abs=1e-6), (x, j)
            moved += abs(signal) > 1e-3
        mean_baseline = sum(p * (conts[0].reward - conts[0].token_advantages[b1]) for p, _, conts, _ in outcomes)
        v1, v2 = value(chain, x[:b1], 4, partial_credit), value(chain, x[:b2], 4, partial_credit)
        assert mean_baseline / mass == pytest.approx((partial_credit(x) + v2) / 2, abs=1e-6), x
        off_value += abs((partial_credit(x) + v2) / 2 - v1) > 1e-3
    assert moved > 0 and off_value > 0  # the gradient is not trivially 0, and the baseline is not v(b_1)


def test_a_sampled_scale_breaks_the_segment_credit():
    """With the group std as the scale (GroupNormalize, scale group) no single factor relates the segments'
    expected credit to the values they added: the ratio differs between segments and initial completions."""
    ratios = []
    for x, outcomes in conditional_on_the_initial(GroupNormalize(scale="group")).items():
        mass = sum(p for p, *_ in outcomes)
        b1, b2 = (c.branch_point for c in outcomes[0][2])
        v1, v2 = value(chain, x[:b1], 4, partial_credit), value(chain, x[:b2], 4, partial_credit)
        for k, added in ((b1, v2 - v1), (b2, partial_credit(x) - v2)):
            if abs(added) > 1e-3:
                ratios.append(sum(p * initial.token_advantages[k] for p, initial, _, _ in outcomes) / mass / added)
    assert max(ratios) - min(ratios) > 0.1


# ---- the group a forest logs --------------------------------------------------------------------------------------
def test_group_size_mean_counts_every_tree_of_the_forest():
    """T = 3 trees, K = 2 continuations a point, at most n = 2 points (`fixed`), fallback_generations 5. Prompt 0's
    completions have 10 tokens (2 points), prompt 1's 2 (1 point), prompt 2's 1 (no point: sampled plainly).
    Groups: 3 x (1 + 2 x 2) = 15, 3 x (1 + 2 x 1) = 9, max(3, 5) = 5; mean 29/3. Per tree (9 initial
    completions): 9 points, branches_mean 1 (per prompt it would be 3); 6 branched, 6 by a token rule; 1 of 3
    prompts plain. So group_size_mean = T (1 + K b) + f (fallback_generations - T) = 3 x 3 + 2/3."""
    engine = LogprobEngine(
        {1000: (list(range(10)), [-1.0] * 10), 1001: ([3, 4], [-1.0] * 2), 1002: ([5], [-1.0])}, continuation=[25]
    )
    variant = STORPO(trees=3, completions_per_step=2, max_steps=2, step_rule="fixed", fallback_generations=5)
    rollouts = variant.generate_rollouts(engine, _prompts(3), pipeline_from_function(lambda t, a: 0.0), decode)
    sizes = [sum(r.group_id == g for r in rollouts) for g in range(3)]
    assert sizes == [15, 9, 5]
    metrics = rollout_metrics([RolloutStats.of(r) for r in rollouts], rollout_s=1.0)
    assert metrics["rollout/group_size_mean"] == pytest.approx(29 / 3)
    assert {k: v for k, v in variant.metrics.items() if "reward" not in k} == {
        "rollout/storpo_branches_mean": 1.0,
        "rollout/storpo_branched_frac": 6 / 9,
        "rollout/storpo_fallback_frac": 1 / 3,
        "rollout/storpo_token_rule_frac": 6 / 9,
    }
    b, f = variant.metrics["rollout/storpo_branches_mean"], variant.metrics["rollout/storpo_fallback_frac"]
    assert metrics["rollout/group_size_mean"] == pytest.approx(3 * (1 + 2 * b) + f * (5 - 3))


def test_a_forest_that_branches_everywhere_logs_t_times_one_plus_k_n():
    """Two prompts of 10-token completions, T = 2, K = 3, n = 2: every group 2 x (1 + 3 x 2) = 14 rollouts."""
    engine = LogprobEngine({1000: (list(range(10)), [-1.0] * 10), 1001: (list(range(10)), [-1.0] * 10)}, [25])
    variant = STORPO(trees=2, completions_per_step=3, max_steps=2, step_rule="fixed")
    rollouts = variant.generate_rollouts(engine, _prompts(2), pipeline_from_function(lambda t, a: 0.0), decode)
    assert rollout_metrics([RolloutStats.of(r) for r in rollouts], rollout_s=1.0)["rollout/group_size_mean"] == 14.0
    assert variant.metrics["rollout/storpo_branches_mean"] == 2.0


# ---- which transforms value the root by the other trees ----------------------------------------------------------
def halve(rewards, group_ids):
    """A plain-function group transform (no declared baseline)."""
    return rewards / 2


TRANSFORMS = {
    "group": {"_target_": "grpo_lightning.rewards.transforms.GroupNormalize", "scale": "none"},
    "batch": {"_target_": "grpo_lightning.rewards.transforms.BatchNormalize"},
    "ema": {"_target_": "grpo_lightning.rewards.transforms.EMABaseline"},
    "halve": {"_target_": "tests.unit.test_storpo_estimator.halve"},
}


@pytest.mark.parametrize(
    ("chain_of", "centres"),
    [
        ((), False),  # no transform: the reward itself
        (("group",), True),
        (("batch",), False),  # the round's mean, not each group's
        (("ema",), False),  # a running baseline
        (("halve",), False),  # a plain function is taken not to centre
        (("group", "halve"), True),  # the last transform that centres decides
        (("batch", "group"), True),
        (("group", "ema"), False),
    ],
)
def test_centres_on_group_says_whether_each_group_sums_to_zero(chain_of, centres):
    """The flag, by hand, and what it means: the pipeline's advantages add up to 0 in every group (rewards whose
    group means differ, so no other baseline gives that by chance)."""
    node = {
        "terms": {"gsm8k": {"_target_": "grpo_lightning.rewards.gsm8k.GSM8KReward"}},
        "group_transforms": {name: dict(TRANSFORMS[name]) for name in chain_of},
    }
    pipeline = build_reward(node)
    for stage in pipeline.group_transforms:
        if isinstance(stage.fn, EMABaseline):
            stage.fn.value = 0.25  # the running baseline from earlier rounds
    assert pipeline.centres_on_group() is centres
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    advantages = pipeline.advantages(rewards, groups)  # [7]
    sums = [float(advantages[groups == g].sum()) for g in (0, 1)]
    assert all(abs(s) < 1e-6 for s in sums) is centres


def test_batch_normalize_with_tree_credit_by_hand():
    """BatchNormalize centres on the round's mean, so the root is worth 0 and each initial completion's tokens add up
    to its own A. Round: group 0 a forest (tree 0: initial r = 1, continuations at 2 with r = 0, 1; tree 1:
    initial r = 0, continuations at 3 with r = 0, 0), group 1 plain (two initials, r = 1, 1). Rewards 1 0 1 0 0 0
    1 1: mean 1/2, std sqrt(2/7), A = +-u with u = (1/2) / (sqrt(2/7) + 1e-4).
    Tree 0: V(2) = (-u + u) / 2 = 0; initial [0, 2) 0 - 0 = 0, [2, 6) u - 0 = u; continuations -u - mean(u, u) =
    -2u and u - mean(u, -u) = u. Tree 1: V(3) = -u; initial [0, 3) -u - 0, [3, 6) -u + u = 0; continuations
    -u - mean(-u, -u) = 0. Group 1 keeps its scalars (no branch)."""
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    layout = [(0, 0, 0), (0, 0, 2), (0, 0, 2), (0, 1, 0), (0, 1, 3), (0, 1, 3), (1, 0, 0), (1, 1, 0)]  # group, tree, b
    rollouts = [
        Rollout([1], list(range(6)), [-1.0] * 6, r, g, False, branch_point=b, tree=t)
        for r, (g, t, b) in zip(rewards, layout, strict=True)
    ]
    reward = pipeline_from_function(lambda text, answer: 0.0)
    reward.group_transforms[0].fn = BatchNormalize()
    assert not reward.centres_on_group()
    STORPO(advantage="tree", trees=2).assign_advantages(rollouts, reward)
    u = 0.5 / (math.sqrt(2 / 7) + 1e-4)
    expected = [
        [0.0] * 2 + [u] * 4,
        [0.0] * 2 + [-2 * u] * 4,
        [0.0] * 2 + [u] * 4,
        [-u] * 3 + [0.0] * 3,
        [0.0] * 3 + [0.0] * 3,
        [0.0] * 3 + [0.0] * 3,
    ]
    for r, want in zip(rollouts[:6], expected, strict=True):
        assert r.token_advantages == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert [r.advantage for r in rollouts] == pytest.approx([u if x else -u for x in rewards], rel=1e-6)
    assert rollouts[6].token_advantages is None and rollouts[7].token_advantages is None
