"""Tests of grpo_lightning.algorithm.losses against hand-worked numbers and naive per-element loops."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss, LossOutput, aggregate, k3_kl, selective_log_softmax

# ---------------------------------------------------------------- selective_log_softmax


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 100])
def test_selective_log_softmax_matches_full_log_softmax(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=gen) * 3
    index = torch.randint(0, 11, (5, 7), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    got = selective_log_softmax(logits, index, chunk_size=chunk_size)
    assert got.dtype == torch.float32
    assert got.shape == (5, 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_selective_log_softmax_bf16_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 50, generator=gen) * 4).to(torch.bfloat16)
    index = torch.randint(0, 50, (3, 4), generator=gen)
    got = selective_log_softmax(logits, index, chunk_size=2)
    assert got.dtype == torch.float32
    # Exact reference on the same (bf16-representable) values in float32.
    exact = torch.log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    # And close to a log-softmax done entirely in bf16.
    low_precision = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1).float()
    torch.testing.assert_close(got, low_precision, atol=0.1, rtol=0.02)


def test_selective_log_softmax_gradient_matches() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(5, 3, 9, generator=gen)
    index = torch.randint(0, 9, (5, 3), generator=gen)
    upstream = torch.randn(5, 3, generator=gen)
    a = base.clone().requires_grad_(True)
    (selective_log_softmax(a, index, chunk_size=2) * upstream).sum().backward()
    b = base.clone().requires_grad_(True)
    ref = torch.log_softmax(b, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_selective_log_softmax_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        selective_log_softmax(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), chunk_size=0)


# ---------------------------------------------------------------- k3_kl


def test_k3_kl_hand_values_and_properties() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[1.0, -1.0, -3.0]])
    # d = ref - logp = [1, 0, -1]; kl = e^d - d - 1
    expected = torch.tensor([[math.e - 2.0, 0.0, math.exp(-1.0)]])
    torch.testing.assert_close(k3_kl(logp, ref), expected)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 6, generator=gen) * 3, torch.randn(4, 6, generator=gen) * 3
    assert (k3_kl(x, y) >= 0).all()
    assert torch.equal(k3_kl(x, x), torch.zeros(4, 6))


# ---------------------------------------------------------------- hand example for the loss

# B = 2, T = 3. Token (1, 2) is masked. epsilon_low = epsilon_high = 0.2, beta = 0.1.
# Row 0: A = +1, ratios [1.5, 0.5, 1.1]
#   surr = min(r*A, clip(r)*A) = [min(1.5, 1.2), min(0.5, 0.8), min(1.1, 1.1)] = [1.2, 0.5, 1.1]
#   (t0 clipped high)
# Row 1: A = -2, ratios [0.7, 1.3, (masked)]
#   surr = [min(-1.4, -1.6), min(-2.6, -2.4)] = [-1.6, -2.6]  (t0 clipped low)
# d = ref - logp: row 0 [0.1, -0.2, 0.0], row 1 [0.3, -0.1, (masked)]
RATIOS = [[1.5, 0.5, 1.1], [0.7, 1.3, 2.0]]
DELTAS = [[0.1, -0.2, 0.0], [0.3, -0.1, 5.0]]
OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]]
BETA = 0.1
SURR = [[1.2, 0.5, 1.1], [-1.6, -2.6]]


def _kl(d: float) -> float:
    return math.exp(d) - d - 1.0


KL = [[_kl(0.1), _kl(-0.2), _kl(0.0)], [_kl(0.3), _kl(-0.1)]]
L = [[-(s - BETA * k) for s, k in zip(srow, krow, strict=True)] for srow, krow in zip(SURR, KL, strict=True)]
TOTAL = sum(L[0]) + sum(L[1])


def _hand_inputs() -> dict[str, torch.Tensor]:
    old = torch.tensor(OLD)
    logp = old + torch.log(torch.tensor(RATIOS))
    return {
        "logp": logp.clone().requires_grad_(True),
        "old_logp": old,
        "ref_logp": logp.detach() + torch.tensor(DELTAS),
        "advantages": torch.tensor([1.0, -2.0]),
        "mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
    }


EXPECTED = {
    "grpo": (sum(L[0]) / 3 + sum(L[1]) / 2) / 2,
    "bnpo": TOTAL / 5,
    "dr_grpo": TOTAL / (2 * 4),
    "dapo": TOTAL / 10,
}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_hand_example_each_loss_type(loss_type: str) -> None:
    loss_fn = GRPOLoss(loss_type=loss_type, beta=BETA, max_completion_length=4)
    out = loss_fn(**_hand_inputs(), num_tokens_in_step=10)
    assert isinstance(out, LossOutput)
    assert out.loss.shape == ()
    assert out.loss.item() == pytest.approx(EXPECTED[loss_type], rel=1e-5)
    assert out.num_tokens.item() == 5
    assert out.kl_mean.item() == pytest.approx((sum(KL[0]) + sum(KL[1])) / 5, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_masked_token_does_not_affect_loss_or_gradient(loss_type: str) -> None:
    loss_fn = GRPOLoss(loss_type=loss_type, beta=BETA, max_completion_length=4)
    inputs = _hand_inputs()
    base = loss_fn(**inputs, num_tokens_in_step=10)
    base.loss.backward()
    changed = _hand_inputs()
    with torch.no_grad():
        changed["logp"][1, 2] = 1e4
        changed["old_logp"][1, 2] = -1e4
        changed["ref_logp"][1, 2] = 3e4
    out = loss_fn(**changed, num_tokens_in_step=10)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(base.loss.item(), rel=1e-6)
    assert out.kl_mean.item() == pytest.approx(base.kl_mean.item(), rel=1e-6)
    assert out.clip_ratio.item() == pytest.approx(base.clip_ratio.item())
    torch.testing.assert_close(changed["logp"].grad, inputs["logp"].grad)
    assert changed["logp"].grad[1, 2].item() == 0.0


def test_clip_ratio_hand_example() -> None:
    out = GRPOLoss(beta=BETA)(**_hand_inputs())
    # 5 trained tokens: one clipped high (row 0, t0: ratio 1.5 > 1.2, A > 0),
    # one clipped low (row 1, t0: ratio 0.7 < 0.8, A < 0).
    # Row 0 t1 has ratio 0.5 < 0.8 but A > 0: not clipped.
    assert out.clip_ratio_high.item() == pytest.approx(1 / 5)
    assert out.clip_ratio_low.item() == pytest.approx(1 / 5)
    assert out.clip_ratio.item() == pytest.approx(2 / 5)
    for metric in (out.kl_mean, out.clip_ratio, out.clip_ratio_low, out.clip_ratio_high, out.num_tokens):
        assert not metric.requires_grad
    assert out.loss.requires_grad


@pytest.mark.parametrize(
    ("ratio", "adv", "low", "high"),
    [
        (0.5, -1.0, 1.0, 0.0),  # below 1 - eps_low with A < 0: clipped term is the min
        (0.5, 1.0, 0.0, 0.0),  # below 1 - eps_low with A > 0: unclipped term is the min
        (1.5, 1.0, 0.0, 1.0),  # above 1 + eps_high with A > 0: clipped
        (1.5, -1.0, 0.0, 0.0),  # above 1 + eps_high with A < 0: unclipped
        (1.1, 1.0, 0.0, 0.0),  # inside the clip range
    ],
)
def test_clip_ratio_single_token(ratio: float, adv: float, low: float, high: float) -> None:
    logp = torch.tensor([[math.log(ratio)]])
    out = GRPOLoss(beta=0.0)(logp, torch.zeros(1, 1), None, torch.tensor([adv]), torch.ones(1, 1))
    assert (out.clip_ratio_low.item(), out.clip_ratio_high.item()) == (low, high)
    assert out.clip_ratio.item() == low + high


def test_asymmetric_clip_range() -> None:
    # epsilon_high = 0.6: ratio 1.5 with A > 0 is no longer clipped; only row 1 t0 is (low).
    loss_fn = GRPOLoss(beta=0.0, epsilon_low=0.2, epsilon_high=0.6, loss_type="bnpo")
    out = loss_fn(**_hand_inputs())
    assert out.clip_ratio_high.item() == 0.0
    assert out.clip_ratio_low.item() == pytest.approx(1 / 5)
    surr = [1.5, 0.5, 1.1, -1.6, -2.6]
    assert out.loss.item() == pytest.approx(-sum(surr) / 5, rel=1e-5)


def test_kl_zero_when_ref_equals_logp_and_when_beta_zero() -> None:
    inputs = _hand_inputs()
    inputs["ref_logp"] = inputs["logp"].detach().clone()
    out = GRPOLoss(beta=0.5)(**inputs)
    assert out.kl_mean.item() == 0.0
    out0 = GRPOLoss(beta=0.0)(**{**_hand_inputs(), "ref_logp": None})
    assert out0.kl_mean.item() == 0.0


# ---------------------------------------------------------------- gradients


def _random_batch(seed: int, b: int = 4, t: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen) * 3
    mask = (torch.rand(b, t, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    return {
        "logp": logp,
        "ref_logp": logp - torch.randn(b, t, generator=gen) * 0.5,
        "advantages": torch.randn(b, generator=gen),
        "mask": mask,
    }


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_gradient_on_policy(loss_type: str, beta: float) -> None:
    data = _random_batch(seed=4)
    b, t = data["mask"].shape
    lmax, n_step = 7, 40
    logp = data["logp"].clone().requires_grad_(True)
    loss_fn = GRPOLoss(loss_type=loss_type, beta=beta, max_completion_length=lmax)
    out = loss_fn(logp, logp.detach(), data["ref_logp"], data["advantages"], data["mask"], n_step)
    out.loss.backward()
    # Naive loop: with ratio == 1 the surrogate gradient is -A_i per token;
    # k3 adds beta * (1 - e^(ref - logp)).
    m = data["mask"].tolist()
    total_tokens = sum(sum(row) for row in m)
    expected = torch.zeros(b, t)
    for i in range(b):
        for j in range(t):
            if m[i][j] == 0:
                continue
            d_kl = 1.0 - math.exp(data["ref_logp"][i, j].item() - data["logp"][i, j].item())
            g = -data["advantages"][i].item() + beta * d_kl
            norm = {
                "grpo": sum(m[i]) * b,
                "bnpo": total_tokens,
                "dr_grpo": b * lmax,
                "dapo": n_step,
            }[loss_type]
            expected[i, j] = g / norm
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=1e-5)


def test_gradient_beta_zero_by_hand() -> None:
    # Row 0: A = 2, 2 trained tokens; row 1: A = -1, 1 trained token.
    # grpo: d loss / d logp_ij = -A_i / (n_i * B).
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = GRPOLoss(beta=0.0)(logp, logp.detach(), None, torch.tensor([2.0, -1.0]), mask)
    out.loss.backward()
    expected = torch.tensor([[-2.0 / (2 * 2), -2.0 / (2 * 2)], [1.0 / (1 * 2), 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    # Value: ratio 1 everywhere, so loss = mean_i(-A_i) = (-2 + 1) / 2.
    assert out.loss.item() == pytest.approx(-0.5)


# ---------------------------------------------------------------- dapo across micro-batches


def test_dapo_micro_batches_sum_to_full_batch() -> None:
    data = _random_batch(seed=5, b=6, t=5)
    gen = torch.Generator().manual_seed(6)
    old = data["logp"] + torch.randn(6, 5, generator=gen) * 0.3  # some ratios far from 1 -> clipping
    n_step = data["mask"].sum().item()
    loss_fn = GRPOLoss(loss_type="dapo", beta=0.2, epsilon_high=0.28)

    full_logp = data["logp"].clone().requires_grad_(True)
    full = loss_fn(full_logp, old, data["ref_logp"], data["advantages"], data["mask"], n_step)
    full.loss.backward()

    micro_logp = data["logp"].clone().requires_grad_(True)
    total = torch.zeros(())
    for sl in (slice(0, 2), slice(2, 6)):
        part = loss_fn(micro_logp[sl], old[sl], data["ref_logp"][sl], data["advantages"][sl], data["mask"][sl], n_step)
        part.loss.backward()
        total = total + part.loss.detach()

    assert total.item() == pytest.approx(full.loss.item(), rel=1e-5)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad)


def test_dapo_requires_num_tokens_in_step() -> None:
    inputs = _hand_inputs()
    with pytest.raises(ValueError, match="num_tokens_in_step"):
        GRPOLoss(loss_type="dapo", beta=BETA)(**inputs)


# ---------------------------------------------------------------- aggregate directly


def test_aggregate_hand_values() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert aggregate(per_token, mask, "grpo", 10).item() == pytest.approx(((1 + 2) / 2 + (4 + 5) / 2) / 2)
    assert aggregate(per_token, mask, "bnpo", 10).item() == pytest.approx(12 / 4)
    assert aggregate(per_token, mask, "dr_grpo", 10).item() == pytest.approx(12 / 20)
    assert aggregate(per_token, mask, "dapo", 10, num_tokens_in_step=8).item() == pytest.approx(12 / 8)
    empty = torch.zeros(2, 3)
    assert aggregate(per_token, empty, "grpo", 10).item() == 0.0
    assert aggregate(per_token, empty, "bnpo", 10).item() == 0.0
    assert aggregate(per_token, empty, "dapo", 10, num_tokens_in_step=0).item() == 0.0
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(per_token, mask, "mean", 10)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"loss_type": "foo"},
            "loss.loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, or the import path "
            "of a LossType subclass (got 'foo')",
        ),
        ({"beta": -1.0}, "loss.beta must be >= 0 (got -1.0)"),
        ({"beta": float("nan")}, "loss.beta must be a finite number (got nan)"),
        ({"epsilon_low": 1.0}, "loss.epsilon_low must be < 1 (got 1.0)"),
        ({"epsilon_low": -0.1}, "loss.epsilon_low must be >= 0 (got -0.1)"),
        ({"epsilon_high": -0.5}, "loss.epsilon_high must be >= 0 (got -0.5)"),
        ({"max_completion_length": 0}, "loss.max_completion_length must be >= 1 (got 0)"),
    ],
)
def test_config_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        GRPOLoss(**kwargs)
    assert str(excinfo.value) == message


def test_valid_config_and_needs_reference() -> None:
    assert GRPOLoss(beta=0.04).needs_reference
    assert not GRPOLoss().needs_reference  # beta 0 by default (loss=grpo): no reference forward
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        GRPOLoss(loss_type=loss_type, epsilon_low=0.0, epsilon_high=0.0)


def test_call_validation() -> None:
    inputs = _hand_inputs()
    with pytest.raises(ValueError, match="ref_logp"):
        GRPOLoss(beta=0.1)(**{**inputs, "ref_logp": None})
    with pytest.raises(ValueError, match="advantages"):
        GRPOLoss(beta=0.1)(**{**inputs, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match="mask"):
        GRPOLoss(beta=0.1)(**{**inputs, "mask": torch.ones(2, 2)})


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _new_type_expected(loss_type: str) -> tuple[float, list[list[float]]]:
    """(loss, d loss / d logp) of the hand example, written out per token from the formulas (TRL 1.16's sapo, luspo,
    vespo); the KL term's gradient is beta * (1 - e^(ref - logp))."""
    adv, mask = [1.0, -2.0], [[1, 1, 1], [1, 1, 0]]
    logp = [[o + math.log(r) for o, r in zip(orow, rrow, strict=True)] for orow, rrow in zip(OLD, RATIOS, strict=True)]
    kl_grad = [[BETA * (1 - math.exp(d)) for d in row] for row in DELTAS]
    terms, grads = [[0.0] * 3 for _ in range(2)], [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        w = math.prod(RATIOS[i][j] for j in range(3) if mask[i][j])  # VESPO: exp of the summed log-ratios
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phi = math.exp(lam + k * math.log(w) - lam * w)
        for j in range(3):
            if not mask[i][j]:
                continue
            r, a = RATIOS[i][j], adv[i]
            if loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                s = _sigmoid(tau * (r - 1))
                terms[i][j], grads[i][j] = -4 / tau * s * a, -4 * s * (1 - s) * r * a
            elif loss_type == "luspo":
                clipped = min(max(r, 0.8), 1.2)
                terms[i][j] = -min(r * a, clipped * a)
                grads[i][j] = -r * a if r * a <= clipped * a else 0.0
            else:  # vespo
                terms[i][j], grads[i][j] = -phi * a * logp[i][j], -phi * a
            terms[i][j] += BETA * KL[i][j]
            grads[i][j] += kl_grad[i][j]
    if loss_type == "sapo":  # grpo's aggregation
        lengths = [sum(row) for row in mask]
        loss = sum(sum(terms[i]) / lengths[i] for i in range(2)) / 2
        grads = [[g / lengths[i] / 2 for g in grads[i]] for i in range(2)]
    elif loss_type == "luspo":  # each sequence's token sum, mean over sequences
        loss = sum(sum(row) for row in terms) / 2
        grads = [[g / 2 for g in row] for row in grads]
    else:  # dapo's: the step's 10 trained tokens
        loss = sum(sum(row) for row in terms) / 10
        grads = [[g / 10 for g in row] for row in grads]
    return loss, grads


@pytest.mark.parametrize("loss_type", ["sapo", "luspo", "vespo"])
def test_hand_example_of_the_gated_and_sequence_weighted_types(loss_type: str) -> None:
    loss_fn = GRPOLoss(loss_type=loss_type, beta=BETA, max_completion_length=4)
    inputs = _hand_inputs()
    out = loss_fn(**inputs, num_tokens_in_step=10)
    out.loss.backward()
    loss, grads = _new_type_expected(loss_type)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor(grads), rtol=1e-5, atol=1e-7)
    if loss_type != "luspo":
        assert out.clip_ratio.item() == 0.0  # no clip


def test_vespo_refuses_a_separate_rollout_correction() -> None:
    from grpo_lightning.algorithm.rollout_correction import RolloutCorrection

    with pytest.raises(ValueError, match="loss.rollout_correction.enabled=true with loss_type vespo"):
        GRPOLoss(loss_type="vespo", rollout_correction=RolloutCorrection(enabled=True))
