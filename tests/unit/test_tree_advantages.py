"""STORPO's tree credit: a tree computed by hand, its telescoping property, the per-token advantages through
collation into every loss type (a constant per-token advantage reproduces the scalar path), and gradients against
a plain float64 computation."""

import random

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.algorithm.tree_advantages import chain_tree_advantages
from grpo_lightning.rewards.pipeline import pipeline_from_function
from grpo_lightning.types import Rollout
from grpo_lightning.variants.storpo import STORPO
from tests.unit.test_branch_points import LogprobEngine, _prompts


# ---- the tree by hand -----------------------------------------------------------------------------------------
def test_a_tree_by_hand():
    """Initial completion of 10 tokens (reward 1), branched at 3 (continuations 0 and 0) and at 7 (1 and 0).

    V(root) = mean(1, 0, 0, 1, 0) = 0.4; V(3) = the same five (every continuation passes through the first 3
    tokens) = 0.4; V(7) = mean(initial 1, 1, 0) = 2/3. Initial: [0, 3) V(3) - V(root) = 0, [3, 7) V(7) - V(3) =
    4/15, [7, 10) 1 - V(7) = 1/3. Continuations from 3: 0 - 0.4; from 7: 1 - 2/3 and 0 - 2/3.
    """
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    branch = [0, 3, 3, 7, 7]
    lengths = [10, 8, 9, 12, 11]
    out = chain_tree_advantages(rewards, branch, lengths)
    assert out[0] == pytest.approx([0.0] * 3 + [4 / 15] * 4 + [1 / 3] * 3)
    assert out[1] == pytest.approx([0.0] * 3 + [-0.4] * 5)
    assert out[2] == pytest.approx([0.0] * 3 + [-0.4] * 6)
    assert out[3] == pytest.approx([0.0] * 7 + [1 / 3] * 5)
    assert out[4] == pytest.approx([0.0] * 7 + [-2 / 3] * 4)


def test_input_order_does_not_matter_and_mistakes_are_refused():
    out = chain_tree_advantages([0.0, 1.0, 1.0], [4, 0, 2], [6, 6, 5])
    ref = chain_tree_advantages([1.0, 1.0, 0.0], [0, 2, 4], [6, 5, 6])
    assert out == [ref[2], ref[0], ref[1]]
    with pytest.raises(ValueError, match="exactly one initial"):
        chain_tree_advantages([0.0, 1.0], [0, 0], [3, 3])
    with pytest.raises(ValueError, match="inside the initial"):
        chain_tree_advantages([0.0, 1.0], [0, 3], [3, 5])


@pytest.mark.parametrize("seed", range(25))
def test_segments_telescope_to_the_flat_advantage(seed):
    """Summed once per segment along any completion, the tree's advantages give A - V(root): the tree moves credit
    between segments and adds none. V(root) is the group mean, computed here independently."""
    rng = random.Random(seed)
    length = rng.randint(2, 30)
    points = sorted(rng.sample(range(1, length), rng.randint(1, min(4, length - 1))))
    branch = [0] + [k for k in points for _ in range(rng.randint(1, 3))]
    lengths = [length] + [k + rng.randint(1, 10) for k in branch[1:]]
    adv = [rng.choice([0.0, 1.0, 0.3]) for _ in branch]
    out = chain_tree_advantages(adv, branch, lengths)
    root = sum(adv) / len(adv)
    segments_of_initial = [0, *points, length]
    total = sum(out[0][start] for start in segments_of_initial[:-1])  # one token of each segment
    assert total == pytest.approx(adv[0] - root)
    for i in range(1, len(branch)):
        before = sum(out[0][start] for start in segments_of_initial[:-1] if start < branch[i])  # shared segments
        assert before + out[i][branch[i]] == pytest.approx(adv[i] - root)
        assert out[i][: branch[i]] == [0.0] * branch[i]


# ---- STORPO assigns it ------------------------------------------------------------------------------------------
def test_storpo_tree_credit_on_a_scripted_engine():
    """Group 0 branches at the fixed points of 10 tokens, 2 of them (10 // 3 = 3 and 20 // 3 = 6); group 1's
    completion has one token, so its prompt is a plain group, which keeps its scalars."""
    engine = LogprobEngine({1000: (list(range(10)), [-1.0] * 10), 1001: ([5], [-1.0])}, continuation=[25])
    reward = pipeline_from_function(lambda text, answer: float(text.endswith("z")))
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731
    tree = STORPO(completions_per_step=2, max_steps=2, step_rule="fixed", fallback_generations=3, advantage="tree")
    flat = STORPO(completions_per_step=2, max_steps=2, step_rule="fixed", fallback_generations=3, advantage="group")
    rollouts = tree.generate_rollouts(engine, _prompts(2), reward, decode)
    baseline = flat.generate_rollouts(engine, _prompts(2), reward, decode)
    assert [r.advantage for r in rollouts] == [r.advantage for r in baseline]  # the scalars are group's, bit for bit
    assert all(r.token_advantages is None for r in baseline)
    group0 = [r for r in rollouts if r.group_id == 0]
    assert [r.branch_point for r in group0] == [0, 3, 3, 6, 6]
    expected = chain_tree_advantages(
        [r.advantage for r in group0], [0, 3, 3, 6, 6], [len(r.completion_ids) for r in group0]
    )
    assert [r.token_advantages for r in group0] == expected
    # the initial (reward 0) and four continuations ending in "z" (reward 1): the initial's last segment is the
    # only one whose outcome fell; the continuations' own tokens all rose
    assert group0[0].token_advantages[-1] < 0 and all(r.token_advantages[-1] > 0 for r in group0[1:])
    assert all(r.token_advantages is None for r in rollouts if r.group_id == 1)


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
