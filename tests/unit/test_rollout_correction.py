"""The rollout correction (grpo_lightning/algorithm/rollout_correction.py) against hand-worked values and a plain
float64 computation written here: TIS and MIS at token and sequence level, the `auto` switch, the key checks, and
the weight's place in the loss (the policy-gradient term only, never the KL term; no gradient through it)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollout_correction import RolloutCorrection, correction_needed
from tests.conftest import make_cfg

ON = {"enabled": True}

# ---------------------------------------------------------------- the auto switch


@pytest.mark.parametrize(
    ("staleness", "sync_every", "engine", "model", "precision", "needed"),
    [
        (0, 1, "auto", "float32", "32-true", False),  # HF engine on the CPU: the policy samples itself
        (0, 1, "float32", "float32", "32-true", False),  # vLLM in the trainer's dtype
        (0, 1, "bfloat16", "bfloat16", "bf16-mixed", False),  # the GPU recipe: bf16 weights, bf16 autocast
        (0, 1, "auto", "bfloat16", "bf16-true", False),
        (0, 1, "float16", "float16", "16-mixed", False),
        (1, 1, "auto", "float32", "32-true", True),  # rounds overlap
        (0, 2, "float32", "float32", "32-true", True),  # weights pushed every other round
        (0, 1, "bfloat16", "float32", "32-true", True),  # a bf16 engine beside a float32 trainer
        (0, 1, "auto", "float32", "bf16-mixed", True),  # float32 sampling, bf16 autocast training
        (0, 1, "float32", "float32", "16-mixed", True),
        (0, 1, "float32", "float32", 32, False),  # Lightning's integer precision
        (None, 1, "auto", "float32", "32-true", False),  # rollout.max_staleness: null
    ],
)
def test_correction_is_needed_exactly_where_generator_and_trainer_differ(
    staleness, sync_every, engine, model, precision, needed
):
    assert correction_needed(staleness, sync_every, engine, model, precision) is needed


def test_enabled_true_or_false_overrides_auto():
    differ = {"sync_every": 3}
    assert RolloutCorrection(**differ).active
    assert not RolloutCorrection(enabled=False, **differ).active
    assert RolloutCorrection(enabled=True).active
    assert not RolloutCorrection().active


@pytest.mark.parametrize(
    ("overrides", "active"),
    [
        ([], False),  # the default: HF engine, float32, 32-true
        (["rollout.max_staleness=1"], True),  # overlapped rounds
        (["rollout.max_staleness=0"], False),
        (["generator=vllm"], False),  # generator.dtype: ${model.dtype}
        (["generator=vllm", "generator.dtype=bfloat16"], True),
        (["generator=vllm", "generator.sync_every=2"], True),
        (["trainer.precision=bf16-mixed"], True),
        (["model.dtype=bfloat16", "trainer.precision=bf16-mixed"], False),
        (["generator=vllm", "generator.dtype=bfloat16", "loss.rollout_correction.enabled=false"], False),
        (["loss=gspo", "loss.rollout_correction.enabled=true"], True),
    ],
)
def test_auto_reads_the_composed_config(tmp_path, overrides, active):
    from hydra.utils import instantiate

    loss = instantiate(make_cfg(tmp_path, overrides).loss)
    assert isinstance(loss.rollout_correction, RolloutCorrection)
    assert loss.rollout_correction.active is active


# ---------------------------------------------------------------- key checks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cap": 1.0}, "loss.rollout_correction.cap must be > 1 (got 1.0)"),
        ({"cap": 0.5}, "loss.rollout_correction.cap must be > 1 (got 0.5)"),
        ({"low": 1.0}, "loss.rollout_correction.low must be < 1 (got 1.0)"),
        ({"low": -0.1}, "loss.rollout_correction.low must be >= 0 (got -0.1)"),
        ({"high": 1.0}, "loss.rollout_correction.high must be > 1 (got 1.0)"),
        ({"level": "batch"}, "loss.rollout_correction.level must be one of token, sequence (got 'batch')"),
        ({"mode": "clip"}, "loss.rollout_correction.mode must be one of truncate, mask (got 'clip')"),
        ({"enabled": "yes"}, "loss.rollout_correction.enabled must be auto, true or false (got 'yes')"),
        ({"max_staleness": -1}, "loss.rollout_correction.max_staleness must be >= 0 or null (got -1)"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        RolloutCorrection(**kwargs)
    assert str(excinfo.value) == message


def test_the_config_check_names_the_key_before_anything_loads(tmp_path):
    from grpo_lightning.app.validation import validate

    cfg = make_cfg(tmp_path, ["loss.rollout_correction.cap=1"])
    with pytest.raises(ValueError) as excinfo:
        validate(cfg)
    assert str(excinfo.value) == "loss.rollout_correction.cap must be > 1 (got 1)"


# ---------------------------------------------------------------- the weights, by hand

# Two completions, three tokens; token (1, 2) is not trained. log rho = old - gen:
#   row 0: [log 3, log 0.5, log 1.5]   row 1: [log 0.25, log 1.2, (untrained: log 100)]
RHO = [[3.0, 0.5, 1.5], [0.25, 1.2, 100.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _old_gen() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]], dtype=torch.float64)
    return old, old - torch.tensor(RHO, dtype=torch.float64).log()


def _weights(**kwargs):
    old, gen = _old_gen()
    return RolloutCorrection(enabled=True, **kwargs).weights(old, gen, torch.tensor(MASK))


def test_token_truncation_by_hand():
    out = _weights(level="token", mode="truncate", cap=2.0)
    torch.testing.assert_close(out.weight[:, :2], torch.tensor([[2.0, 0.5], [0.25, 1.2]], dtype=torch.float64))
    assert out.weight[0, 2].item() == pytest.approx(1.5)
    assert out.ratio_mean.item() == pytest.approx((3.0 + 0.5 + 1.5 + 0.25 + 1.2) / 5)
    assert out.ratio_max.item() == pytest.approx(3.0)  # the untrained token's 100 is not counted
    assert out.capped_frac.item() == pytest.approx(1 / 5)
    assert out.masked_frac.item() == 0.0


def test_token_mask_by_hand():
    out = _weights(level="token", mode="mask", low=0.4, high=2.5)
    # 3.0 > 2.5 and 0.25 < 0.4 get weight 0; the others keep their ratio (IcePop's M(k) = k inside [a, b]).
    torch.testing.assert_close(out.weight[:, :2], torch.tensor([[0.0, 0.5], [0.0, 1.2]], dtype=torch.float64))
    assert out.weight[0, 2].item() == pytest.approx(1.5)
    assert out.masked_frac.item() == pytest.approx(2 / 5)
    assert out.capped_frac.item() == 0.0


def test_sequence_level_uses_the_product_over_trained_tokens():
    # row 0: 3 * 0.5 * 1.5 = 2.25; row 1: 0.25 * 1.2 = 0.3 (the untrained token's 100 left out)
    truncated = _weights(level="sequence", mode="truncate", cap=2.0)
    assert truncated.weight.shape == (2, 1)
    torch.testing.assert_close(truncated.weight, torch.tensor([[2.0], [0.3]], dtype=torch.float64))
    assert truncated.ratio_mean.item() == pytest.approx((2.25 + 0.3) / 2)
    assert truncated.ratio_max.item() == pytest.approx(2.25)
    assert truncated.capped_frac.item() == pytest.approx(1 / 2)
    masked = _weights(level="sequence", mode="mask", low=0.5, high=5.0)
    torch.testing.assert_close(masked.weight, torch.tensor([[2.25], [0.0]], dtype=torch.float64))
    assert masked.masked_frac.item() == pytest.approx(1 / 2)


def test_a_sequence_product_far_out_of_range_stays_finite():
    old = torch.zeros(1, 200)
    gen = torch.full((1, 200), -1.0)  # log of the product: 200
    out = RolloutCorrection(enabled=True, level="sequence").weights(old, gen, torch.ones(1, 200))
    assert out.weight.item() == 2.0 and math.isfinite(out.ratio_max.item())
    nan_gen = torch.tensor([[float("nan"), -1.0]])  # a missing generator log-prob: ratio 1 (as TRL)
    out = RolloutCorrection(enabled=True).weights(torch.zeros(1, 2), nan_gen, torch.ones(1, 2))
    assert out.weight[0, 0].item() == 1.0 and out.weight[0, 1].item() == 2.0


# ---------------------------------------------------------------- in the loss: the policy-gradient term only


def _plain_loss(logp, old, gen, ref, adv, mask, beta, level, mode, cap=2.0, low=0.5, high=5.0):
    """grpo loss with the correction, element by element in float64 (Python floats)."""
    rows = []
    for i in range(len(mask)):
        trained = [t for t in range(len(mask[i])) if mask[i][t]]
        if level == "sequence":
            rho_seq = math.exp(sum(old[i][t] - gen[i][t] for t in trained))
        terms = []
        for t in trained:
            rho = rho_seq if level == "sequence" else math.exp(old[i][t] - gen[i][t])
            w = min(rho, cap) if mode == "truncate" else (rho if low <= rho <= high else 0.0)
            r = math.exp(logp[i][t] - old[i][t])
            surr = min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i])
            d = ref[i][t] - logp[i][t]
            terms.append(-w * surr + beta * (math.exp(d) - d - 1.0))
        rows.append(sum(terms) / max(len(trained), 1))
    return sum(rows) / len(rows)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_loss_and_gradient_match_a_plain_float64_computation(level, mode):
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 5
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    gen_logp = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * (1.0 if level == "token" else 0.6)
    ref = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    mask[:, 0] = 1.0
    beta = 0.3
    loss_fn = GRPOLoss(beta=beta, rollout_correction=RolloutCorrection(enabled=True, level=level, mode=mode))
    x = logp.clone().requires_grad_(True)
    out = loss_fn(x, old, ref, adv, mask, gen_logp=gen_logp)
    out.loss.backward()

    args = [v.tolist() for v in (old, gen_logp, ref, adv, mask)]
    expected = _plain_loss(logp.tolist(), *args, beta=beta, level=level, mode=mode)
    assert out.loss.item() == pytest.approx(expected, rel=1e-9)
    h = 1e-6  # central differences of the plain computation: its gradient, with nothing held constant by hand
    numeric = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            up, down = logp.clone(), logp.clone()
            up[i, j] += h
            down[i, j] -= h
            numeric[i, j] = (
                _plain_loss(up.tolist(), *args, beta=beta, level=level, mode=mode)
                - _plain_loss(down.tolist(), *args, beta=beta, level=level, mode=mode)
            ) / (2 * h)
    torch.testing.assert_close(x.grad, numeric, atol=1e-7, rtol=1e-5)
    acted = out.correction.masked_frac if mode == "mask" else out.correction.capped_frac
    assert 0 < acted.item() < 1  # the case exercises the cap or the mask, and leaves some units alone


def test_the_weight_scales_the_policy_gradient_and_leaves_the_kl_gradient_alone():
    # One token, on-policy (ratio 1), A = 1, beta = 0.5, ref - logp = 0.4, generator ratio 4 capped at 2:
    # d loss / d logp = -w * A + beta * (1 - e^0.4) with w = 2.
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.6]], dtype=torch.float64)
    gen_logp = logp.detach() - math.log(4.0)
    loss_fn = GRPOLoss(beta=0.5, rollout_correction=RolloutCorrection(enabled=True, cap=2.0))
    out = loss_fn(logp, logp.detach(), ref, torch.tensor([1.0]), torch.ones(1, 1), gen_logp=gen_logp)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(-2.0 + 0.5 * (1.0 - math.exp(0.4)), rel=1e-12)
    assert out.loss.item() == pytest.approx(-2.0 + 0.5 * (math.exp(0.4) - 0.4 - 1.0), rel=1e-12)


def test_no_gradient_flows_through_the_weight():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logp * 1.0  # not detached: the weight must still be a constant
    gen_logp = torch.tensor([[-1.5, -2.5]], requires_grad=True)
    loss_fn = GRPOLoss(rollout_correction=RolloutCorrection(enabled=True, cap=10.0))
    out = loss_fn(logp, old, None, torch.tensor([1.0]), torch.ones(1, 2), gen_logp=gen_logp)
    out.loss.backward()
    assert gen_logp.grad is None
    # ratio pi/pi_old = 1 with both differentiable: the surrogate's gradient cancels; only a weight's would remain
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))


def test_off_means_bit_identical_and_on_needs_the_generator_logprobs():
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 4, generator=gen)
    args = (logp, logp + 0.1, None, torch.randn(3, generator=gen), torch.ones(3, 4))
    plain = GRPOLoss()(*args)
    off = GRPOLoss(rollout_correction=RolloutCorrection(enabled=False))(*args, gen_logp=logp - 5.0)
    assert torch.equal(plain.loss, off.loss) and off.correction is None
    with pytest.raises(ValueError, match="gen_logp"):
        GRPOLoss(rollout_correction=RolloutCorrection(**ON))(*args)


def test_the_weight_multiplies_the_gspo_and_cispo_terms_as_well():
    on = RolloutCorrection(enabled=True, cap=2.0)
    gen_shift = torch.tensor([[math.log(3.0), math.log(0.5)]], dtype=torch.float64)  # generator ratios 3 and 0.5
    # CISPO, on-policy, A = 1, 4 tokens in the step: d/dlogp_t = -w_t * min(1, 5) * A / 4 with w = [2, 0.5]
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    loss_fn = GRPOLoss(loss_type="cispo", epsilon_high=5.0, rollout_correction=on)
    out = loss_fn(logp, logp.detach(), None, torch.tensor([1.0]), torch.ones(1, 2), 4, logp.detach() - gen_shift)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.125]], dtype=torch.float64))
    # GSPO, on-policy (s = 1), A = 1: token t's term is -w_t * s * A, and d s / d logp_t = s / 2, so every token
    # gets -(w_0 + w_1) / 2 * (1 / 2) = -0.625
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    loss_fn = GRPOLoss(importance_sampling_level="sequence", rollout_correction=on)
    out = loss_fn(logp, logp.detach(), None, torch.tensor([1.0]), torch.ones(1, 2), gen_logp=logp.detach() - gen_shift)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.625, -0.625]], dtype=torch.float64))
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
