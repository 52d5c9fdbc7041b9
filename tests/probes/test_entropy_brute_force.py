"""Entropy probe on the real training loop against a plain forward and an entropy written here.

Per optimizer step: token entropies from the model's own full logits (float64 softmax), the per-sequence
statistics, the (log p, A) covariance, the gradient of the step's mean token entropy by autograd through that
plain forward dotted with the actual update, and the entropy of the same completions re-scored after the step.
Completions have unequal lengths (one with no trained token); LoRA and full fine-tuning (tied LM head).
"""

import math

import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.probes.entropy import EntropyProbe, RunningAgreement
from grpo_lightning.training.rollout_loop import RolloutLoop
from tests.probes.brute_force import PINNED_SHAPE, StepBatches, UnequalLengths, plain_logits


def _entropy(logits):  # [B, C, V] -> [B, C] float64, differentiable
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


class EntropyTruth(StepBatches):
    def __init__(self, probe) -> None:
        super().__init__()
        self.probe, self.rows = probe, []

    def _token_mean(self, pl_module):
        total, tokens, seq, adv, lp, tok_adv = 0.0, 0.0, [], [], [], []
        for batch in self.batches:
            logits = plain_logits(pl_module.policy, batch, pl_module.temperature)
            mask = batch.completion_mask.double()
            h = _entropy(logits) * mask
            total = total + h.sum()
            tokens += float(mask.sum())
            seq.append((h.sum(-1) / mask.sum(-1).clamp(min=1)).detach())
            if batch.token_advantages is None:  # one advantage per completion, on each of its tokens
                per_token = batch.advantages.double()[:, None].expand_as(mask)
                adv.append(batch.advantages.double())
            else:  # STORPO's tree credit: a sequence's advantage is the mean over its trained tokens
                per_token = batch.token_advantages.double()
                adv.append((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1))
            logp = torch.log_softmax(logits.double(), -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
            keep = mask.bool()
            lp.append(logp.detach()[keep])
            tok_adv.append(per_token[keep])
        return total / tokens, torch.cat(seq), torch.cat(adv), torch.cat(lp), torch.cat(tok_adv)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        mean, seq, adv, lp, tok_adv = self._token_mean(pl_module)
        grads = torch.autograd.grad(mean, params, allow_unused=True)
        self.grad = [
            torch.zeros_like(p).double() if g is None else g.double() for p, g in zip(params, grads, strict=True)
        ]
        self.before = [p.detach().clone() for p in params]
        cov = float(((lp - lp.mean()) * (tok_adv - tok_adv.mean())).mean())
        seq_c, adv_c = seq - seq.mean(), adv - adv.mean()
        self.truth = {
            "token_mean": float(mean),
            "seq_mean": float(seq.mean()),
            "seq_std": float(seq.std()),
            "seq_min": float(seq.min()),
            "seq_max": float(seq.max()),
            "adv_corr": float((seq_c * adv_c).sum() / (seq_c.norm() * adv_c.norm())),
            "cov_logp_adv": cov,
            "projected_delta_cov": -optimizer.param_groups[0]["lr"] * cov,
        }

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:  # after the probe's
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]
        delta = [(p.detach() - b).double() for p, b in zip(params, self.before, strict=True)]
        self.truth["projected_delta_first_order"] = float(
            sum((g * d).sum() for g, d in zip(self.grad, delta, strict=True))
        )
        self.truth["actual_delta"] = float(self._token_mean(pl_module)[0]) - self.truth["token_mean"]
        self.rows.append((dict(self.truth), dict(self.probe.last_metrics)))


@pytest.mark.parametrize(
    ("lora", "variant"),
    [(True, []), (False, []), (True, ["variant=storpo", "variant.advantage=tree", "variant.step_rule=fixed"])],
    ids=["lora", "full", "storpo-tree"],
)
def test_entropy_probe_matches_a_plain_forward(tiny_cfg, lora, variant):
    cfg = tiny_cfg(
        f"model.lora.enabled={lora}",
        *variant,
        "probe=[entropy]",
        "probe.entropy.measure_actual=true",
        "probe.entropy.first_order=true",
        "trainer.max_epochs=2",
        "eval.enabled=false",
        "trainer.accumulate_grad_batches=2",  # 2 optimizer steps per round
        *PINNED_SHAPE,
    )
    run = build_run(cfg)
    rollout_cb = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
    rollout_cb.sampler.variant = UnequalLengths(rollout_cb.sampler.variant)
    probe = next(c for c in run.trainer.callbacks if isinstance(c, EntropyProbe))
    truth = EntropyTruth(probe)
    run.trainer.callbacks.append(truth)
    run.fit()
    if variant:  # per-token advantages reached the probe
        assert any(b.token_advantages is not None for b in truth.batches)
    assert len(truth.rows) == 4
    for expected, logged in truth.rows:
        scale = abs(expected["actual_delta"]) + abs(expected["projected_delta_first_order"])
        for key, value in expected.items():
            if key in ("projected_delta_first_order", "actual_delta"):
                # float32 forwards by two different code paths: ~1e-7 of a ~10-nat entropy per token
                assert logged[key] == pytest.approx(value, rel=1e-3, abs=1e-3 * scale + 1e-7), key
            elif key.endswith("corr"):
                # a correlation of per-sequence entropies that differ by ~5e-5 nats (near-uniform tiny model),
                # each from a float32 forward by two code paths: ~1e-5 of the correlation, asserted with margin
                assert logged[key] == pytest.approx(value, abs=1e-4), key
            else:
                assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_running_agreement_counts_only_steps_with_a_change_and_signs_of_zero():
    running = RunningAgreement()
    running.update(projected=-1e-3, actual=0.0)  # nothing changed: no sign to agree with
    running.update(projected=0.0, actual=0.0)
    assert running.n == 0 and math.isnan(running.sign_agreement) and math.isnan(running.correlation)
    running.update(projected=-0.0, actual=2e-4)  # a projection of (negative) zero did not predict the rise
    running.update(projected=1e-4, actual=3e-4)
    running.update(projected=-2e-4, actual=-1e-4)
    assert running.n == 3 and running.sign_agreement == pytest.approx(2 / 3)
    x = torch.tensor([0.0, 1e-4, -2e-4], dtype=torch.float64)
    y = torch.tensor([2e-4, 3e-4, -1e-4], dtype=torch.float64)
    xc, yc = x.double() - x.double().mean(), y.double() - y.double().mean()
    assert running.correlation == pytest.approx(float((xc * yc).sum() / (xc.norm() * yc.norm())), rel=1e-9)


class ConstantReward:
    """Every completion scores the same: every advantage is 0, no step changes anything."""

    def __call__(self, completion: str, answer: str) -> float:
        return 0.5


def test_no_change_logs_no_sign_agreement(tiny_cfg):
    cfg = tiny_cfg(
        "probe=[entropy]",
        "probe.entropy.measure_actual=true",
        "probe.entropy.first_order=true",
        "~reward.terms.vowels",
        "+reward.terms.const._target_=tests.probes.test_entropy_brute_force.ConstantReward",
        "loss.beta=0",
        "trainer.max_epochs=2",
        "eval.enabled=false",
        *PINNED_SHAPE,
    )
    run = build_run(cfg)
    probe = next(c for c in run.trainer.callbacks if isinstance(c, EntropyProbe))
    run.fit()
    metrics = probe.last_metrics
    assert metrics["actual_delta"] == 0.0 and metrics["projected_delta_first_order"] == 0.0
    for key in ("sign_agreement_cov", "sign_agreement_first_order", "corr_actual_cov", "corr_actual_first_order"):
        assert math.isnan(metrics[key]), key  # undefined, hence not logged (the probe drops NaN on one process)
