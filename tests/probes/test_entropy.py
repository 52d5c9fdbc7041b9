"""Entropy probe: token entropy and its logit gradient against brute force, Pearson by hand, projections."""

import math

import lightning as L
import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.probes.entropy import EntropyProbe, entropy_and_logit_grad, pearson, token_entropy


def test_token_entropy_equals_brute_force_on_the_tiny_model(tiny_model):
    ids = torch.randint(0, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny_model(ids).logits  # [3, 7, V]
    expected = torch.zeros(3, 7, dtype=torch.float64)
    for b in range(3):
        for t in range(7):
            p = torch.softmax(logits[b, t].double(), -1)
            expected[b, t] = -(p * p.log()).sum()
    assert torch.allclose(token_entropy(logits), expected, atol=1e-10)
    assert torch.allclose(entropy_and_logit_grad(logits)[0], expected, atol=1e-10)


def test_entropy_logit_grad_equals_autograd():
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[1.0, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    h = -(p * torch.log_softmax(logits, -1)).sum(-1)  # [3, 5]
    (expected,) = torch.autograd.grad((h * weights).sum(), logits)
    entropy, grad = entropy_and_logit_grad(logits.detach(), weights)
    assert torch.allclose(entropy, h.detach(), atol=1e-12)
    assert torch.allclose(grad.double(), expected, atol=1e-6)  # the gradient is handed over in float32


def test_pearson_by_hand():
    # x = [1, 2, 3], y = [1, 2, 4]: deviations [-1, 0, 1] and [-4/3, -1/3, 5/3];
    # sum of products 3, sums of squares 2 and 42/9 -> r = 3 / sqrt(2 * 42 / 9) = 9 / sqrt(84).
    assert pearson(torch.tensor([1.0, 2, 3]), torch.tensor([1.0, 2, 4])) == pytest.approx(9 / math.sqrt(84))
    assert math.isnan(pearson(torch.tensor([1.0, 1, 1]), torch.tensor([1.0, 2, 4])))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_order_projection_predicts_the_actual_change_at_small_lr(tiny_cfg, seed):
    cfg = tiny_cfg(
        "probe=[entropy]",
        "probe.entropy.measure_actual=true",
        "probe.entropy.first_order=true",
        f"seed={seed}",
        "optim.optimizer.lr=1e-4",  # LoRA: Adam's first steps move each adapter weight by ~1e-4
        "trainer.max_epochs=3",
    )
    run = build_run(cfg)
    probe = next(cb for cb in run.trainer.callbacks if isinstance(cb, EntropyProbe))
    rows = []
    run.trainer.callbacks.append(_Recorder(probe, rows))
    run.fit()
    assert len(rows) == 3
    # The first-order error is O(lr^2) in absolute terms: compare it with the typical size of a step's change,
    # not with each step's own change, which can cancel to near zero (one step here moved the entropy 1.5e-9
    # while the others moved it ~3e-8).
    scale = sum(abs(r["actual_delta"]) for r in rows) / len(rows)
    for row in rows:
        assert row["projected_delta_first_order"] == pytest.approx(row["actual_delta"], abs=0.10 * scale)
    assert 0.0 <= rows[-1]["sign_agreement_cov"] <= 1.0
    assert rows[-1]["sign_agreement_first_order"] == 1.0
    assert rows[-1]["corr_actual_first_order"] > 0.9


class _Recorder(L.Callback):
    """Copies the probe's metrics after every optimizer step (it runs after the probe)."""

    def __init__(self, probe, rows):
        self.probe, self.rows = probe, rows

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.probe.last_metrics and (not self.rows or self.rows[-1] is not self.probe.last_metrics):
            self.rows.append(self.probe.last_metrics)


@pytest.mark.parametrize(
    ("kwargs", "key"), [({"every_n_steps": 0}, "every_n_steps"), ({"chunk_size": 0}, "chunk_size")]
)
def test_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"probe.entropy.{key}"):
        EntropyProbe(**kwargs)
