"""GNS probe on the real training loop against per-completion gradients, for every loss type.

Each optimizer step's per-completion gradients come from autograd through a plain forward of the tiny model and
a loss written here; from them: the micro-batch gradients g_i (the loss type applied to the micro-batch alone),
their batch sizes B_i, the step gradient G_big = sum_i a_i g_i (checked against `.grad`), and the two-batch-size
estimates of tr(S) and |G|^2, which the probe must reproduce. Completions have unequal lengths and one has no
trained token, so every weighting matters.
"""

import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.probes.gns import GradientNoiseScaleProbe
from grpo_lightning.training.rollout_loop import RolloutLoop
from tests.probes.brute_force import (
    PINNED_SHAPE,
    StepBatches,
    UnequalLengths,
    completion_values,
    completion_weights,
    flat_grad,
    plain_logprobs,
)


class GNSTruth(StepBatches):
    def __init__(self, probe, loss_type: str) -> None:
        super().__init__()
        self.probe, self.loss_type, self.rows = probe, loss_type, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # runs after the probe's
        params = [p for p in pl_module.parameters() if p.requires_grad]
        temperature, max_len = pl_module.temperature, pl_module.loss_fn.max_completion_length
        step_completions = sum(len(b) for b in self.batches)
        step_tokens = sum(float(b.completion_mask.sum()) for b in self.batches)
        micro, sizes = [], []
        for batch in self.batches:
            logp = plain_logprobs(pl_module.policy, batch, temperature)
            values = completion_values(logp, batch, self.loss_type, max_len, step_completions, step_tokens)
            per_completion = torch.stack([flat_grad(v, params) for v in values])  # [B, P]
            w = completion_weights(batch, self.loss_type)
            micro.append((w[:, None] * per_completion).sum(0) / w.sum())  # g_i: the micro-batch's own loss
            sizes.append(float(w.sum() ** 2 / w.pow(2).sum()))
        m = len(micro)
        share = [b / sum(sizes) for b in sizes] if self.loss_type == "dapo" else [1 / m] * m  # a_i
        big = sum(a * g for a, g in zip(share, micro, strict=True))
        grad = torch.cat([p.grad.reshape(-1).double() for p in params])
        assert torch.allclose(big, grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()))  # the loss is the loss
        mean_sq = sum(float(g.pow(2).sum()) for g in micro) / m
        big_sq = float(big.pow(2).sum())
        b_small = m / sum(1 / b for b in sizes)
        b_big = 1 / sum(a * a / b for a, b in zip(share, sizes, strict=True))
        tr = (mean_sq - big_sq) / (1 / b_small - 1 / b_big)
        g2 = (b_big * big_sq - b_small * mean_sq) / (b_big - b_small)
        truth = {"gns_B_small": b_small, "gns_B_big": b_big, "gns_G2_big": big_sq, "gns_tr_sigma": tr, "gns_G2": g2}
        self.rows.append((truth, dict(self.probe.last_estimates), sizes))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gns_matches_per_completion_gradients(tiny_cfg, loss_type):
    cfg = tiny_cfg(
        f"loss={loss_type}",
        "loss.beta=0",
        "probe=[gns]",
        "trainer.max_epochs=2",
        "eval.enabled=false",
        *PINNED_SHAPE,
    )
    run = build_run(cfg)
    rollout_cb = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
    rollout_cb.sampler.variant = UnequalLengths(rollout_cb.sampler.variant)
    probe = next(c for c in run.trainer.callbacks if isinstance(c, GradientNoiseScaleProbe))
    truth = GNSTruth(probe, loss_type)
    run.trainer.callbacks.append(truth)
    run.fit()
    assert len(truth.rows) == 2
    for expected, logged, sizes in truth.rows:
        if loss_type == "bnpo":
            assert len(set(round(b, 6) for b in sizes)) > 1  # unequal micro-batch sizes: harmonic mean matters
        else:
            assert sizes == [4.0] * len(sizes)  # every completion counts once, the untrained one included
        for key, value in expected.items():
            scale = abs(expected["gns_tr_sigma"]) / expected["gns_B_small"] if key == "gns_G2" else abs(value)
            assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-4 * scale), key
