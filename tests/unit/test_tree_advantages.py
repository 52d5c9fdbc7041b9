"""STORPO's tree credit: a tree computed by hand, its telescoping property, the per-token advantages through
collation into every loss type (a constant per-token advantage reproduces the scalar path), and gradients against
a plain float64 computation."""

import random

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.algorithm.tree_advantages import forest_advantages
from grpo_lightning.rewards.pipeline import pipeline_from_function
from grpo_lightning.types import Rollout
from grpo_lightning.variants.storpo import STORPO
from tests.unit.test_branch_points import LogprobEngine, _prompts


# ---- the forest by hand ---------------------------------------------------------------------------------------
def test_a_forest_by_hand():
    """Two trees of one prompt. Tree 0: an initial of 10 tokens (A = 1), continuations at 3 (A = 0, 0) and at 7
    (A = 1, 0). Tree 1: an initial of 6 tokens (A = 0), continuations at 2 (A = 0, 1).

    Tree 0: V(root) = the other tree's mean = 1/3; V(3) = mean(0, 0) = 0; V(7) = mean(1, 0) = 1/2. Initial:
    [0, 3) V(3) - V(root) = -1/3, [3, 7) V(7) - V(3) = 1/2, [7, 10) 1 - V(7) = 1/2. Continuations from 3: each
    0 - mean of the tree's others through 3 (initial 1, the other 0, and 1, 0 from 7) = -1/2; from 7: 1 - mean(1,
    0) = 1/2 and 0 - mean(1, 1) = -1. Tree 1: V(root) = tree 0's mean = 2/5; V(2) = 1/2. Initial: [0, 2)
    1/2 - 2/5 = 1/10, [2, 6) 0 - 1/2; continuations from 2: 0 - mean(0, 1) = -1/2, 1 - mean(0, 0) = 1.
    """
    adv = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    branch = [0, 3, 3, 7, 7, 0, 2, 2]
    trees = [0, 0, 0, 0, 0, 1, 1, 1]
    lengths = [10, 8, 9, 12, 11, 6, 5, 7]
    out = forest_advantages(adv, branch, trees, lengths, root_from_other_trees=True)
    assert out[0] == pytest.approx([-1 / 3] * 3 + [1 / 2] * 4 + [1 / 2] * 3)
    assert out[1] == pytest.approx([0.0] * 3 + [-1 / 2] * 5)
    assert out[2] == pytest.approx([0.0] * 3 + [-1 / 2] * 6)
    assert out[3] == pytest.approx([0.0] * 7 + [1 / 2] * 5)
    assert out[4] == pytest.approx([0.0] * 7 + [-1.0] * 4)
    assert out[5] == pytest.approx([1 / 10] * 2 + [-1 / 2] * 4)
    assert out[6] == pytest.approx([0.0] * 2 + [-1 / 2] * 3)
    assert out[7] == pytest.approx([0.0] * 2 + [1.0] * 5)
    # a transform with a baseline of its own (EMA, the batch mean): the root is worth 0
    own = forest_advantages(adv, branch, trees, lengths, root_from_other_trees=False)
    assert own[0][0] == pytest.approx(0.0 - 0.0) and own[5][0] == pytest.approx(1 / 2)
    assert own[1:5] == out[1:5] and own[0][3:] == out[0][3:]


def test_one_tree_credits_its_first_segment_from_its_continuations():
    """One tree (no other to value the root by): the root is the transforms' baseline, 0 in A's units, and the
    first segment is credited V(b_1) - 0 = the continuations' mean, no longer V(b_1) - V(b_1) = 0."""
    out = forest_advantages([0.5, -1.0, -1.0, 0.5, 1.0], [0, 2, 2, 4, 4], [0] * 5, [6, 5, 5, 6, 6], True)
    assert out[0] == pytest.approx([-1.0] * 2 + [1.75] * 2 + [-0.25] * 2)


def test_input_order_does_not_matter_and_mistakes_are_refused():
    out = forest_advantages([0.0, 1.0, 1.0, 0.5], [4, 0, 2, 0], [0, 0, 0, 1], [6, 6, 5, 3], True)
    ref = forest_advantages([1.0, 1.0, 0.0, 0.5], [0, 2, 4, 0], [0, 0, 0, 1], [6, 5, 6, 3], True)
    assert out == [ref[2], ref[0], ref[1], ref[3]]
    with pytest.raises(ValueError, match="exactly one initial"):
        forest_advantages([0.0, 1.0], [0, 0], [0, 0], [3, 3], True)
    with pytest.raises(ValueError, match="inside its initial"):
        forest_advantages([0.0, 1.0], [0, 3], [0, 0], [3, 5], True)


def _brute_force_forest(adv, branch, trees, lengths, root_from_other_trees):
    """The estimator as docs/algorithm.md states it, token by token: for each token of each completion, the segment
    it lies in, and that segment's values from the samples that do not contain it."""
    n = len(adv)
    out = []
    for i in range(n):
        tree = [j for j in range(n) if trees[j] == trees[i]]
        initial = next(j for j in tree if branch[j] == 0)
        others = [adv[j] for j in range(n) if trees[j] != trees[i]]
        v_root = sum(others) / len(others) if root_from_other_trees and others else 0.0

        def value(b, tree=tree):  # the continuations branched exactly at b, fresh samples from that prefix
            at = [adv[j] for j in tree if branch[j] == b and b > 0]
            return sum(at) / len(at)

        points = sorted({branch[j] for j in tree if branch[j] > 0})
        row = []
        for position in range(lengths[i]):
            if i == initial:
                before = [b for b in points if b <= position]
                after = [b for b in points if b > position]
                start = value(before[-1]) if before else v_root
                end = value(after[0]) if after else adv[i]
                row.append(end - start)
            elif position < branch[i]:
                row.append(0.0)
            else:
                mates = [adv[j] for j in tree if j != i and (branch[j] == 0 or branch[j] >= branch[i])]
                row.append(adv[i] - sum(mates) / len(mates))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_the_forest_against_a_brute_force_statement(seed):
    rng = random.Random(seed)
    adv, branch, trees, lengths = [], [], [], []
    for tree in range(rng.randint(1, 4)):
        length = rng.randint(1, 30)
        points = sorted(rng.sample(range(1, length), rng.randint(0, min(4, length - 1)))) if length > 1 else []
        for k in [0] + [k for k in points for _ in range(rng.randint(1, 3))]:
            adv.append(rng.choice([0.0, 1.0, 0.3, -0.7]))
            branch.append(k)
            trees.append(tree)
            lengths.append(length if k == 0 else k + rng.randint(1, 10))
    order = list(range(len(adv)))
    rng.shuffle(order)  # the input order is free
    adv, branch, trees, lengths = ([x[i] for i in order] for x in (adv, branch, trees, lengths))
    for root in (True, False):
        expected = _brute_force_forest(adv, branch, trees, lengths, root)
        got = forest_advantages(adv, branch, trees, lengths, root)
        assert [len(row) for row in got] == lengths
        for row, want in zip(got, expected, strict=True):
            assert row == pytest.approx(want, abs=1e-12)
        # along every initial completion the segments telescope to A - V(root)
        for i in (i for i in range(len(adv)) if branch[i] == 0):
            points = sorted({branch[j] for j in range(len(adv)) if trees[j] == trees[i] and branch[j] > 0})
            others = [adv[j] for j in range(len(adv)) if trees[j] != trees[i]]
            v_root = sum(others) / len(others) if root and others else 0.0
            assert sum(got[i][start] for start in [0, *points]) == pytest.approx(adv[i] - v_root)


def test_the_first_segment_is_credited_when_the_trees_differ():
    """Two trees whose outcomes differ: every token before the first branch point gets the difference between its
    tree's continuations and the other tree, where one tree alone valued by its own mean gave 0."""
    out = forest_advantages([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0, 2, 2, 0, 2, 2], [0, 0, 0, 1, 1, 1], [5] * 6, True)
    assert out[0][:2] == [1.0, 1.0] and out[3][:2] == [-1.0, -1.0]


# ---- STORPO assigns it ------------------------------------------------------------------------------------------
def test_storpo_forest_credit_on_a_scripted_engine():
    """Two trees a prompt. Group 0's completions branch at the fixed points of 10 tokens (3 and 6); group 1's have
    one token, so no tree of its prompt branches: a plain group of fallback_generations, which keeps its scalars."""
    engine = LogprobEngine({1000: (list(range(10)), [-1.0] * 10), 1001: ([5], [-1.0])}, continuation=[25])
    reward = pipeline_from_function(lambda text, answer: float(text.endswith("z")))
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731
    settings = dict(trees=2, completions_per_step=2, max_steps=2, step_rule="fixed", fallback_generations=3)
    rollouts = STORPO(advantage="tree", **settings).generate_rollouts(engine, _prompts(2), reward, decode)
    flat = STORPO(advantage="group", **settings).generate_rollouts(engine, _prompts(2), reward, decode)
    assert [r.advantage for r in rollouts] == [r.advantage for r in flat]  # the scalars are group's, bit for bit
    group0 = [r for r in rollouts if r.group_id == 0]
    assert [(r.tree, r.branch_point) for r in group0] == [(0, 0), (1, 0)] + [(t, k) for t in (0, 1) for k in
                                                                             (3, 3, 6, 6)]  # fmt: skip
    expected = forest_advantages(
        [r.advantage for r in group0], [r.branch_point for r in group0], [r.tree for r in group0],
        [len(r.completion_ids) for r in group0], True,
    )  # fmt: skip
    assert [r.token_advantages for r in group0] == expected
    group1 = [r for r in rollouts if r.group_id == 1]
    assert len(group1) == 3 and all(r.token_advantages is None for r in group1)


# ---- the group transforms keep their baselines -------------------------------------------------------------------
def _forest_rollouts(rewards, branch, trees, length=6):
    return [
        Rollout([1], list(range(length)), [-1.0] * length, r, 0, False, branch_point=b, tree=t)
        for r, b, t in zip(rewards, branch, trees, strict=True)
    ]


REWARDS, BRANCH, TREES = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0], [0, 2, 2, 0, 3, 3], [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("transforms", ["normalize_group", "normalize_batch", "ema"])
def test_the_tree_credit_keeps_what_the_group_transform_meant(transforms):
    """Along an initial completion the tokens add up to the transform's own advantage, relative to the baseline the
    transform means: the other trees' mean for a group normalisation (its leave-one-tree-out form), the running
    baseline for the EMA (which a group mean would have replaced). Worked by hand for REWARDS."""
    from grpo_lightning.rewards.transforms import EMABaseline, GroupNormalize

    if transforms == "ema":
        stage = EMABaseline(decay=0.9)
        stage.value = 0.25  # the running baseline b from earlier rounds
    else:
        stage = GroupNormalize(scale=transforms.removeprefix("normalize_"))
    reward = pipeline_from_function(lambda text, answer: 0.0)
    reward.group_transforms[0].fn = stage  # the one group transform under test
    rollouts = _forest_rollouts(REWARDS, BRANCH, TREES)
    STORPO(advantage="tree", trees=2).assign_advantages(rollouts, reward)
    scale = torch.tensor(REWARDS).std().item() + 1e-4  # group and batch std are one here: one group
    for initial, others in ((0, [0.0, 0.0, 1.0]), (3, [1.0, 0.0, 1.0])):  # each tree and the other's rewards
        path = rollouts[initial].token_advantages
        points = [0, BRANCH[initial + 1]]
        total = sum(path[k] for k in points)
        r = REWARDS[initial]
        if transforms == "ema":
            assert total == pytest.approx(r - 0.25)  # the EMA's own A = r - b, kept whole
        else:
            assert total == pytest.approx((r - sum(others) / 3) / scale, rel=1e-6)  # leave-one-tree-out


def test_collation_lays_per_token_advantages_beside_scalar_rows():
    rows = [
        Rollout([1, 2], [3, 4, 5], [-1.0] * 3, 1.0, 0, False, advantage=0.5, token_advantages=[0.0, 0.25, 0.75]),
        Rollout([1], [6, 7], [-1.0] * 2, 0.0, 1, False, advantage=-0.5),
    ]
    batch = collate_rollouts(rows, pad_token_id=0)
    assert batch.token_advantages.tolist() == [[0.0, 0.25, 0.75], [-0.5, -0.5, 0.0]]  # padding 0
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.loss_advantages is batch.token_advantages
    plain = collate_rollouts([rows[1]], pad_token_id=0)
    assert plain.token_advantages is None and plain.loss_advantages is plain.advantages
    assert plain.advantages_per_token.tolist() == [[-0.5, -0.5]]
    with pytest.raises(ValueError, match="token_advantages has 2 entries"):
        Rollout([1], [3, 4, 5], [-1.0] * 3, 0.0, 0, False, token_advantages=[0.0, 1.0])


# ---- every loss type: per-token constant == scalar; gradients against float64 ---------------------------------
LOSSES = {
    "grpo": {},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo", "max_completion_length": 7},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "gspo": {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "grpo_beta": {"beta": 0.04},
}


def _inputs(seed=0, b=4, t=7):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ref = logp + 0.1 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[2, :2] = 0  # a continuation: not trained before its branch point
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    return logp, old, ref, mask, adv


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_constant_per_token_advantage_is_the_scalar_path(name):
    loss_fn = GRPOLoss(**LOSSES[name])
    logp, old, ref, mask, adv = _inputs()
    results = []
    for advantages in (adv, adv[:, None].expand_as(logp).clone()):
        x = logp.clone().requires_grad_(True)
        out = loss_fn(x, old, ref, advantages, mask, num_tokens_in_step=mask.sum())
        out.loss.backward()
        results.append((out.loss.detach(), x.grad, out.clip_ratio_low, out.clip_ratio_high))
    (loss_s, grad_s, low_s, high_s), (loss_t, grad_t, low_t, high_t) = results
    assert torch.equal(loss_s, loss_t)
    if name == "gspo":  # GSPO-token: the same value; its gradient reaches each token by another route
        torch.testing.assert_close(grad_t, grad_s, rtol=1e-12, atol=1e-15)
    else:
        assert torch.equal(grad_s, grad_t)
        assert torch.equal(low_s, low_t) and torch.equal(high_s, high_t)


def _float64_reference(name, logp, old, ref, mask, adv):
    """The loss written out token by token in float64, from the formulas (docs/algorithm.md), per-token A."""
    cfg = LOSSES[name]
    eps_low, eps_high = cfg.get("epsilon_low", 0.2), cfg.get("epsilon_high", 0.2)
    beta, loss_type = cfg.get("beta", 0.0), cfg.get("loss_type", "grpo")
    b, t = logp.shape
    rows, total_tokens = [], float(mask.sum())
    for i in range(b):
        trained = [j for j in range(t) if mask[i, j] > 0]
        if cfg.get("importance_sampling_level") == "sequence":
            s_i = torch.exp(sum(logp[i, j] - old[i, j] for j in trained) / len(trained))
        terms = []
        for j in trained:
            if cfg.get("importance_sampling_level") == "sequence":  # GSPO-token: sg(s_i) * pi / sg(pi)
                ratio = s_i.detach() * torch.exp(logp[i, j] - logp[i, j].detach())
            else:
                ratio = torch.exp(logp[i, j] - old[i, j])
            a = adv[i, j]
            if loss_type == "cispo":
                term = -torch.clamp(ratio, max=eps_high).detach() * a * logp[i, j]
            else:
                term = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            if beta:
                d = ref[i, j] - logp[i, j]
                term = term + beta * (torch.exp(d) - d - 1)
            terms.append(term)
        rows.append(terms)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in rows) / b
    if loss_type == "bnpo":
        return sum(sum(r) for r in rows) / total_tokens
    if loss_type == "dr_grpo":
        return sum(sum(r) for r in rows) / (b * cfg["max_completion_length"])
    return sum(sum(r) for r in rows) / total_tokens  # dapo, cispo: the step's tokens (here: this batch)


@pytest.mark.parametrize("name", list(LOSSES))
def test_per_token_gradients_against_float64_by_hand(name):
    loss_fn = GRPOLoss(**LOSSES[name])
    logp, old, ref, mask, _ = _inputs(seed=3)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    out = loss_fn(x, old, ref, adv, mask, num_tokens_in_step=mask.sum())
    out.loss.backward()
    y = logp.clone().requires_grad_(True)
    expected = _float64_reference(name, y, old, ref, mask, adv)
    expected.backward()
    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)
    assert torch.all(x.grad[mask == 0] == 0)


def test_per_token_advantages_change_which_tokens_move():
    """With per-token credit, a token whose advantage is 0 gets no policy gradient, whatever its row's others."""
    loss_fn = GRPOLoss()
    logp, old, ref, mask, _ = _inputs(seed=5)
    adv = torch.zeros_like(logp)
    adv[1, 3] = 1.0
    x = logp.clone().requires_grad_(True)
    loss_fn(x, logp.detach(), None, adv, mask).loss.backward()
    moved = (x.grad != 0).nonzero().tolist()
    assert moved == [[1, 3]]


def test_the_share_of_trained_tokens_credited_by_hand():
    """Trained tokens whose advantage is not 0: a continuation's after its branch point only."""
    from grpo_lightning.algorithm.round_metrics import credited_tokens

    rows = [
        Rollout([1], [3, 4, 5], [-1.0] * 3, 1.0, 0, False, branch_point=1, token_advantages=[9.0, 0.5, 0.0]),
        Rollout([1], [6, 7, 8], [-1.0] * 3, 0.0, 1, False, advantage=0.0),  # a zero-variance group's
        Rollout([1], [6, 7], [-1.0] * 2, 0.0, 2, False, advantage=0.3),
    ]
    assert credited_tokens(rows) == (1 + 0 + 2, 2 + 3 + 2)
