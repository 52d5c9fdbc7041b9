"""GSPO and CISPO (grpo_lightning/algorithm/losses.py) against hand-worked cases and second implementations written
here in float64: GSPO-token as the paper writes it (sg[s_i] * pi / sg[pi]), CISPO element by element."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss


def gspo(**kwargs) -> GRPOLoss:
    return GRPOLoss(importance_sampling_level="sequence", **kwargs)


def cispo(**kwargs) -> GRPOLoss:
    return GRPOLoss(loss_type="cispo", **{"epsilon_high": 5.0, **kwargs})


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_cases():
    # Three completions of two trained tokens each, epsilon 0.2 both sides.
    #   row 0: log-ratios [0.3, 0.1], s = e^0.2 = 1.2214 > 1.2, A = +1: clipped, no gradient; loss -1.2
    #   row 1: the same ratios, A = -1: min(-s, -1.2) = -s, unclipped; loss s, d/dlogp_t = s / 2
    #   row 2: log-ratios [0.1, -0.1], s = 1, A = +2: loss -2, d/dlogp_t = -2 / 2
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-0.5, -0.7]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.3, 0.1], [0.3, 0.1], [0.1, -0.1]], dtype=torch.float64)).requires_grad_(True)
    out = gspo()(logp, old, None, torch.tensor([1.0, -1.0, 2.0]), torch.ones(3, 2))
    out.loss.backward()
    s = math.exp(0.2)
    assert out.loss.item() == pytest.approx((-1.2 + s - 2.0) / 3, rel=1e-12)
    expected = torch.tensor([[0.0, 0.0], [s / 2, s / 2], [-1.0, -1.0]], dtype=torch.float64) / 3  # / 3: mean over rows
    torch.testing.assert_close(logp.grad, expected)
    # clip fractions count completions: row 0 above the range with A > 0; nothing below with A < 0
    assert out.clip_ratio_high.item() == pytest.approx(1 / 3)
    assert out.clip_ratio_low.item() == 0.0


def test_gspo_untrained_tokens_do_not_enter_the_sequence_ratio():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.1, 9.0]], dtype=torch.float64, requires_grad=True)
    out = gspo(epsilon_high=0.5)(logp, old, None, torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    out.loss.backward()
    s = math.exp(0.1)  # the mean over the two trained tokens
    assert out.loss.item() == pytest.approx(-s, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]], dtype=torch.float64))


def gspo_token_reference(logp, old, ref, adv, mask, eps_low, eps_high, beta):  # float64, the paper's GSPO-token
    """Zheng et al. 2025, eq. (13)-(14): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], clipped like PPO's ratio,
    per-completion token mean, then the mean over completions (TRL's `grpo` aggregation), plus beta * k3."""
    total = 0.0
    for i in range(logp.shape[0]):
        keep = mask[i] != 0
        n = int(keep.sum())
        s_i = torch.exp((logp[i][keep] - old[i][keep]).sum() / max(n, 1))
        s_it = s_i.detach() * torch.exp(logp[i][keep] - logp[i][keep].detach())
        surr = torch.minimum(s_it * adv[i], torch.clamp(s_it, 1 - eps_low, 1 + eps_high) * adv[i])
        d = ref[i][keep] - logp[i][keep]
        total = total + (-surr + beta * (torch.exp(d) - d - 1)).sum() / max(n, 1)
    return total / logp.shape[0]


@pytest.mark.parametrize(("eps_low", "eps_high", "beta"), [(3e-4, 4e-4, 0.0), (0.02, 0.03, 0.2)])
def test_gspo_equals_gspo_token_in_value_and_gradient(eps_low, eps_high, beta):
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 6
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.1
    old[::2] = logp[::2]  # half the completions on-policy (s = 1): inside any clip range
    ref = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    mask[:, 0] = 1.0
    ours = logp.clone().requires_grad_(True)
    out = gspo(epsilon_low=eps_low, epsilon_high=eps_high, beta=beta)(ours, old, ref, adv, mask)
    out.loss.backward()
    theirs = logp.clone().requires_grad_(True)
    expected = gspo_token_reference(theirs, old, ref, adv, mask, eps_low, eps_high, beta)
    expected.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)
    assert 0 < out.clip_ratio.item() < 1  # some completions clipped, the on-policy ones not


# ---------------------------------------------------------------- CISPO


def test_cispo_hand_case_keeps_the_gradient_of_a_token_far_off_policy():
    # One completion, ratios [0.5, 1, 8], cap 5, A = 2, 10 tokens in the step:
    # loss = -sum_t min(r_t, 5) * A * logp_t / 10 and d/dlogp_t = -min(r_t, 5) * A / 10 (the weight is a constant).
    old = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.5, 1.0, 8.0]], dtype=torch.float64).log()).requires_grad_(True)
    out = cispo()(logp, old, None, torch.tensor([2.0]), torch.ones(1, 3), num_tokens_in_step=10)
    out.loss.backward()
    lp = logp.detach()[0].tolist()
    assert out.loss.item() == pytest.approx(-(0.5 * lp[0] + 1.0 * lp[1] + 5.0 * lp[2]) * 2 / 10, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.1, -0.2, -1.0]], dtype=torch.float64))
    assert out.clip_ratio_high.item() == pytest.approx(1 / 3) and out.clip_ratio_low.item() == 0.0
    # PPO's clipped surrogate gives the same token (ratio 8 > 1.2, A > 0) no gradient at all
    clipped = logp.detach().clone().requires_grad_(True)
    GRPOLoss(loss_type="dapo")(clipped, old, None, torch.tensor([2.0]), torch.ones(1, 3), 10).loss.backward()
    assert clipped.grad[0, 2].item() == 0.0


def test_cispo_matches_a_plain_float64_computation():
    gen = torch.Generator().manual_seed(3)
    b, t, n_step, beta = 5, 6, 40, 0.1
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp - torch.randn(b, t, generator=gen, dtype=torch.float64).abs() * 1.5  # ratios up to ~e^4
    ref = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    x = logp.clone().requires_grad_(True)
    out = cispo(beta=beta)(x, old, ref, adv, mask, n_step)
    out.loss.backward()
    loss, grad, capped = 0.0, torch.zeros(b, t, dtype=torch.float64), 0
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            r = math.exp(logp[i, j].item() - old[i, j].item())
            w = min(r, 5.0)
            d = ref[i, j].item() - logp[i, j].item()
            loss += (-w * adv[i].item() * logp[i, j].item() + beta * (math.exp(d) - d - 1)) / n_step
            grad[i, j] = (-w * adv[i].item() + beta * (1 - math.exp(d))) / n_step
            capped += r > 5.0 and adv[i].item() > 0
    assert out.loss.item() == pytest.approx(loss, rel=1e-10)
    torch.testing.assert_close(x.grad, grad)
    assert capped > 0 and out.clip_ratio_high.item() == pytest.approx(capped / mask.sum().item())


def test_cispo_is_normalised_by_the_step_like_dapo():
    loss_fn = cispo()
    assert loss_fn.step_weighting == "sample"
    assert loss_fn.step_loss(torch.tensor(1.5), accumulate_grad_batches=4, world_size=2).item() == 12.0
    with pytest.raises(ValueError, match="num_tokens_in_step"):
        loss_fn(torch.zeros(1, 2), torch.zeros(1, 2), None, torch.ones(1), torch.ones(1, 2))
    gen = torch.Generator().manual_seed(5)
    logp, old = -torch.rand(6, 4, generator=gen), -torch.rand(6, 4, generator=gen)
    adv, mask = torch.randn(6, generator=gen), torch.ones(6, 4)
    full = loss_fn(logp, old, None, adv, mask, 24).loss
    parts = (
        loss_fn(logp[:2], old[:2], None, adv[:2], mask[:2], 24).loss
        + loss_fn(logp[2:], old[2:], None, adv[2:], mask[2:], 24).loss
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_cispo_cap_below_one_is_refused_naming_the_key():
    with pytest.raises(ValueError) as excinfo:
        GRPOLoss(loss_type="cispo", epsilon_high=0.28)
    assert str(excinfo.value) == (
        "loss.epsilon_high must be >= 1 for loss_type cispo, where it caps the IS weight itself (TRL's convention; "
        "ScaleRL: 5.0) (got 0.28)"
    )
    with pytest.raises(ValueError) as excinfo:
        GRPOLoss(importance_sampling_level="batch")
    assert str(excinfo.value) == "loss.importance_sampling_level must be one of token, sequence (got 'batch')"
