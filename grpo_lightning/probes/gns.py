"""Gradient noise scale probe (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A).

Two batch sizes give two unbiased equations (docs/probes.md): micro-batch gradients g_i (batch
B_i) and the optimizer step's synchronised gradient G_big (batch B_b, all micro-batches of all ranks):

    E|g_i|^2   = |G|^2 + tr(S) / B_i          E|G_big|^2 = |G|^2 + tr(S) / B_b
    B_s        = m / sum_i (1 / B_i)          (harmonic mean over the step's m micro-batches: then
                                               E[mean_i |g_i|^2] = |G|^2 + tr(S) / B_s exactly)
    trS_hat    = (mean_i |g_i|^2 - |G_big|^2) / (1/B_s - 1/B_b)
    G2_hat     = (B_b |G_big|^2 - B_s mean_i |g_i|^2) / (B_b - B_s)

Sample unit and g_i, by the loss type (algorithm/loss_types.py: each type's `sample_weights` and
`step_weighting`, which the module passes on): the loss of a micro-batch is a weighted mean of one value per
completion, g_i is the gradient of that micro-batch loss on its own, and B_i is the weights' effective sample size
(sum w)^2 / sum w^2 (equal weights: the completions; weights n_j, the trained tokens: (sum n)^2 / sum n^2).

- `step_weighting = "micro_batch"`: Lightning averages the step's m micro-batch losses, so G_big = sum_i a_i g_i
  with a_i = 1/m, and 1/B_b = sum_i a_i^2 / B_i gives B_b = m B_s.
- `step_weighting = "sample"`: the step's loss is one mean over ALL the step's completions (a token sum over the
  step / N_step = the mean of token sum / nbar, nbar = N_step / completions in the step, a constant within the
  step). The micro-batch's own loss is the mean of that value over its completions, and the module multiplies
  the micro-batch loss by accumulate x world size so the summed gradient is the step's mean: g_i =
  (B_step / (W B_i)) h_i with h_i the gradient Lightning's backward sees, a_i = B_i / B_step, and B_b = B_step.

B_b is the whole step's effective sample size in both cases (`gns_B_big`); B_s is logged as `gns_B_small`.

Completions of one prompt share a group-relative advantage and are not independent; micro-batches hold whole
groups, so the estimates describe batches of groups made of such completions (the unit is still completions).

Why hooks and not gradient snapshots: a tensor hook on each trainable parameter receives that backward's own
gradient h_i before it is accumulated into `.grad` (local to the rank even under DDP, as in petuum/adaptdl), so
|h_i|^2 is a running sum of float32 dot products (BLAS, no copy of a gradient), accumulated in float64; 7
scalars are all-reduced per step. The hooks count only between `on_before_backward` and `on_after_backward`:
other gradient computations (the entropy probe's `torch.autograd.grad`) fire the same hooks.

Consistency ratio: the hook also sums <h_i, .grad before h_i> (the gradients accumulated so far), so
|sum_i h_i|^2 = sum_i |h_i|^2 + 2 sum_i <h_i, sum_{j<i} h_j> is known without storing a gradient. On one process
`.grad` at the optimizer step IS sum_i h_i, so the ratio |sum_i h_i|^2 / |.grad|^2 is 1.0 (up to float32
rounding, ~1e-7) when the hooks saw every gradient that reached `.grad`. Under DDP `.grad` is averaged over
ranks and the ratio is not logged.

Smoothing: single-step estimates are noisy and G2_hat is often negative. `B_simple` is EMA(trS_hat) /
EMA(G2_hat) (bias-corrected EMAs, numerator and denominator averaged separately), logged only while
EMA(G2_hat) is at least `min_snr` standard errors above zero; the standard error comes from the EMA-weighted
spread of the per-step G2_hat. Otherwise the ratio would divide by ~0 and report any number: `B_simple_defined`
is 0 on those steps and `B_simple` is not logged.

With one micro-batch per step on one process there is a single batch size (B_s = B_b): tr(S) and |G|^2 are not
separable, so only `gns_G2_big` (the biased |G_big|^2) and the batch sizes are logged, never the estimators.
"""

from __future__ import annotations

import functools
import logging
import math

import lightning as L
import torch
from torch import Tensor

from grpo_lightning.probes.base import Probe, ProbedModule

log = logging.getLogger(__name__)

# Per-step sums over micro-batches (then over ranks): |h_i|^2, |h_i|^2 / B_i^2, 1 / B_i, B_i, micro-batches,
# |sum_i h_i|^2 (consistency ratio), micro-batches without a sample.
_TOTALS = ("sum_sq", "sum_sq_per_b2", "sum_inv_b", "sum_b", "count", "hook_total", "empty")


def effective_sample_size(weights: Tensor) -> float:  # weights [B] >= 0
    """(sum w)^2 / sum w^2: the number of equally weighted samples with the same variance reduction."""
    weights = weights.detach().double()
    return float(weights.sum() ** 2 / (weights.pow(2).sum().clamp(min=1e-300)))


def gns_estimates(mean_sq: float, b_small: float, b_big: float, big_sq: float) -> dict[str, float]:
    """Unbiased tr(S) and |G|^2 from one optimizer step (module docstring): mean_i |g_i|^2, the harmonic-mean
    micro-batch size B_s, the step's batch size B_b and |G_big|^2. {} when the two batch sizes coincide."""
    if not b_small > 0 or b_big - b_small <= 1e-9 * b_big:
        return {}
    tr_sigma = (mean_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    g2 = (b_big * big_sq - b_small * mean_sq) / (b_big - b_small)
    return {"tr_sigma": tr_sigma, "G2": g2, "B_small": b_small, "B_big": b_big}


def _sq_norm(grad: Tensor) -> Tensor:
    """|grad|^2 as a float64 scalar: a float32 dot product (no float64 copy of the gradient)."""
    g = grad.detach().reshape(-1)
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    return torch.dot(g, g).double()


def _dot(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.dtype not in (torch.float32, torch.float64) or a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return torch.dot(a, b).double()


class SmoothedRatio:
    """Bias-corrected EMAs of a numerator and a denominator, and the denominator's standard error.

    The EMA of n per-step values x_k has weights w_k = (1 - beta) beta^(n-k), normalised by W1 = sum w_k; if
    the x_k are independent with variance s^2, its variance is s^2 W2 / W1^2 (W2 = sum w_k^2). s^2 is
    estimated by the EMA-weighted spread of the x_k themselves (undefined, hence infinite, below two steps).
    """

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.num = self.den = self.den_sq = self.w1 = self.w2 = 0.0
        self.steps = 0

    def update(self, num: float, den: float) -> None:
        b, a = self.beta, 1.0 - self.beta
        self.num, self.den, self.den_sq = b * self.num + a * num, b * self.den + a * den, b * self.den_sq + a * den**2
        self.w1, self.w2 = b * self.w1 + a, b * b * self.w2 + a * a
        self.steps += 1

    @property
    def numerator(self) -> float:
        return self.num / self.w1

    @property
    def denominator(self) -> float:
        return self.den / self.w1

    @property
    def denominator_se(self) -> float:
        if self.steps < 2:
            return math.inf
        spread = max(self.den_sq / self.w1 - self.denominator**2, 0.0)
        # the weighted spread underestimates s^2 by the factor (1 - W2 / W1^2) (as n / (n - 1) for equal weights)
        spread /= max(1.0 - self.w2 / self.w1**2, 1e-12)
        return math.sqrt(spread * self.w2) / self.w1


class GradientNoiseScaleProbe(Probe):
    """Logs `probe/gns/*` every `every_n_steps` optimizer steps; never changes training."""

    def __init__(self, every_n_steps: int = 1, ema_beta: float = 0.9, min_snr: float = 2.0) -> None:
        if every_n_steps < 1:
            raise ValueError(f"probe.gns.every_n_steps must be >= 1 (got {every_n_steps})")
        if not 0 <= ema_beta < 1:
            raise ValueError(f"probe.gns.ema_beta must be in [0, 1) (got {ema_beta})")
        if not min_snr >= 0:
            raise ValueError(f"probe.gns.min_snr must be >= 0 (got {min_snr})")
        self.every_n_steps = every_n_steps
        self.ema_beta = ema_beta
        self.min_snr = min_snr
        self.last_estimates: dict[str, float] = {}
        self._handles: list = []
        self._params: list[torch.nn.Parameter] = []
        self._active = False
        self._armed = False
        self._smoothed = SmoothedRatio(ema_beta)
        self._warned = False
        self._reset_step()

    def check_setup(self, micro_batches_per_step: int, world_size: int) -> None:
        """A run configured so that no estimate can exist is a mistake: say so before training."""
        if micro_batches_per_step * world_size < 2:
            raise ValueError(
                "probe=[gns] needs two batch sizes, but each optimizer step is one micro-batch on one process: "
                "lower data.groups_per_micro_batch or trainer.accumulate_grad_batches, or train on several "
                "processes (trainer=ddp)"
            )

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._handles = [p.register_hook(functools.partial(self._on_grad, p)) for p in self._params]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._params = [], []

    def _reset_step(self) -> None:
        # h_i: micro-batch i's gradient as Lightning's backward sees it; B_i its sample size (module docstring)
        self._totals = dict.fromkeys(_TOTALS, 0.0)
        self._micro_sq: Tensor | float = 0.0  # |h_i|^2 of the running backward (Lightning's scale)
        self._micro_cross: Tensor | float = 0.0  # <h_i, .grad before h_i>

    def _on_grad(self, param: torch.nn.Parameter, grad: Tensor) -> None:
        if self._armed:  # only the training backward; not e.g. another probe's torch.autograd.grad
            self._micro_sq = self._micro_sq + _sq_norm(grad)
            if param.grad is not None:
                self._micro_cross = self._micro_cross + _dot(grad, param.grad)
        return None  # the gradient is never modified

    # ---- per micro-batch -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module: ProbedModule, batch, batch_idx: int) -> None:
        self._active = trainer.global_step % self.every_n_steps == 0
        if self._active:
            self._micro_sq = self._micro_cross = 0.0
            self._batch_ess = effective_sample_size(pl_module.sample_weights(batch))

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._armed = self._active

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._armed = False
        if not self._active:
            return
        sq, b = float(self._micro_sq), self._batch_ess
        t = self._totals
        t["sum_sq"] += sq
        if b > 0:
            t["sum_sq_per_b2"] += sq / b**2
            t["sum_inv_b"] += 1.0 / b
        else:  # no sample (no trained token): the micro-batch estimates nothing, the step is not estimable
            t["empty"] += 1.0
        t["sum_b"] += b
        t["count"] += 1.0
        t["hook_total"] += sq + 2.0 * float(self._micro_cross)

    # ---- per optimizer step --------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module: ProbedModule, optimizer) -> None:
        if not self._active:
            return
        big_sq = float(sum(_sq_norm(p.grad) for p in self._params if p.grad is not None))
        totals = torch.tensor([self._totals[k] for k in _TOTALS], dtype=torch.float64)
        totals = trainer.strategy.reduce(totals.to(pl_module.device), reduce_op="sum").cpu()
        sum_sq, sum_sq_per_b2, inv_b, b_step, count, hook_total, empty = totals.tolist()
        world = float(trainer.world_size)
        per_sample = pl_module.step_weighting == "sample"
        if per_sample:  # one mean over the step's samples: g_i = (B_step / (W B_i)) h_i, a_i = B_i / B_step
            mean_sq = (b_step / world) ** 2 * sum_sq_per_b2 / count
        else:  # Lightning's mean over micro-batches: g_i = m h_i, a_i = 1 / (m W)
            mean_sq = float(trainer.accumulate_grad_batches) ** 2 * sum_sq / count
        b_small = count / inv_b if inv_b > 0 else 0.0
        b_big = b_step if per_sample else count * b_small
        metrics = {"gns_G2_big": big_sq, "gns_B_small": b_small, "gns_B_big": b_big}
        if trainer.world_size == 1 and big_sq > 0:
            metrics["gns_consistency_ratio"] = hook_total / big_sq
        estimates = gns_estimates(mean_sq, b_small, b_big, big_sq) if empty == 0 else {}
        if estimates:
            metrics.update(self._derived(estimates))
        elif not self._warned:
            reason = "a micro-batch without trained tokens" if empty else "one micro-batch per step on one process"
            log.warning("probe.gns: %s: tr(S) and |G|^2 are not estimable on such steps", reason)
            self._warned = True
        self.last_estimates = metrics
        pl_module.log_dict(
            {f"probe/gns/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=1
        )
        self._reset_step()

    def _derived(self, est: dict[str, float]) -> dict[str, float]:
        smooth = self._smoothed
        smooth.update(est["tr_sigma"], est["G2"])
        out = {
            "gns_tr_sigma": est["tr_sigma"],
            "gns_G2": est["G2"],
            "gns_tr_sigma_smoothed": smooth.numerator,
            "gns_G2_smoothed": smooth.denominator,
        }
        if est["G2"] > 0:
            out["gns_mu"] = est["tr_sigma"] / est["B_small"] / est["G2"]
            out["Bsimple_from_mu"] = out["gns_mu"] * est["B_small"]
        se = smooth.denominator_se
        if math.isfinite(se):
            out["gns_G2_smoothed_se"] = se
        defined = smooth.denominator > 0 and (self.min_snr == 0 or smooth.denominator >= self.min_snr * se)
        out["B_simple_defined"] = float(defined)
        if defined:
            out["B_simple"] = smooth.numerator / smooth.denominator
        return out
