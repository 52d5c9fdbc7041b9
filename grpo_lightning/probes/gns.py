"""Gradient noise scale probe (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A).

Two batch sizes give two unbiased equations (REFERENCE §5): micro-batch gradients g_i (batch B_s) and the
optimizer step's synchronised gradient G_big (batch B_b = sum of all B_s, all micro-batches, all ranks):

    E|g_i|^2   = |G|^2 + tr(S) / B_s          E|G_big|^2 = |G|^2 + tr(S) / B_b
    trS_hat    = (mean_i |g_i|^2 - |G_big|^2) / (1/B_s - 1/B_b)
    G2_hat     = (B_b |G_big|^2 - B_s mean_i |g_i|^2) / (B_b - B_s)
    B_simple   = EMA(trS_hat) / EMA(G2_hat)     (numerator and denominator averaged separately)

Why hooks and not the seed's gradient snapshots: a tensor hook on each trainable parameter receives that
backward's own gradient before it is accumulated into `.grad` (local to the rank even under DDP, as in
petuum/adaptdl), so |g_i|^2 is a running sum of squares: no copy of the model, 4 scalars all-reduced per step.
Lightning divides each micro-batch loss by `accumulate_grad_batches`; the probe multiplies that back so g_i is
the gradient of micro-batch i's own loss. The hooks count only between `on_before_backward` and
`on_after_backward`: other gradient computations (the entropy probe's `torch.autograd.grad`) fire the same hooks.

Sample unit: one completion, whose token-mean loss is weighted by the loss type (`GRPOModule.sample_weights`):
equal for `grpo`, proportional to its trained tokens for `bnpo`, `dr_grpo` and `dapo`. B_s of a micro-batch is
its effective sample size ESS = (sum w)^2 / sum w^2 (seed 002). Completions of one prompt share a group-relative
advantage and are not independent; micro-batches hold whole groups, so the estimates describe batches of groups
made of such completions (the B_simple unit is completions, counted by ESS).

Consistency ratio: the hook also sums <h_i, .grad before h_i> (the gradients accumulated so far), so
|sum_i h_i|^2 = sum_i |h_i|^2 + 2 sum_i <h_i, sum_{j<i} h_j> is known without storing a gradient. On one process
`.grad` at the optimizer step IS sum_i h_i, so the ratio |sum_i h_i|^2 / |.grad|^2 is 1.0 exactly (up to the
float32 rounding of `.grad`, ~1e-7) when the hooks saw every gradient that reached `.grad`. Under DDP `.grad` is
averaged over ranks and the ratio is not logged.

With `accumulate_grad_batches = 1` on one process there is a single batch size (B_s = B_b): tr(S) and |G|^2 are
not separable, so only `gns_G2_big` (the biased |G_big|^2) and the ESS are logged, never the estimators.
"""

from __future__ import annotations

import functools
import logging

import lightning as L
import torch
from torch import Tensor

log = logging.getLogger(__name__)


def effective_sample_size(weights: Tensor) -> float:  # weights [B] >= 0
    """(sum w)^2 / sum w^2: the number of equally weighted samples with the same variance reduction."""
    weights = weights.detach().double()
    return float(weights.sum() ** 2 / (weights.pow(2).sum().clamp(min=1e-300)))


def gns_estimates(sum_sq: float, count: float, ess_sum: float, big_sq: float) -> dict[str, float]:
    """Unbiased tr(S) and |G|^2 from the all-reduced scalars of one optimizer step (see module docstring).

    sum_sq: sum_i |g_i|^2 over all micro-batches and ranks; count: their number; ess_sum: sum_i B_s,i (= B_b);
    big_sq: |G_big|^2. B_s is the mean micro-batch ESS. Returns {} when the two batch sizes coincide.
    """
    b_small, b_big = ess_sum / count, ess_sum
    if count < 2 or b_big - b_small <= 1e-9 * b_big:
        return {}
    mean_sq = sum_sq / count
    tr_sigma = (mean_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    g2 = (b_big * big_sq - b_small * mean_sq) / (b_big - b_small)
    return {"tr_sigma": tr_sigma, "G2": g2, "B_small": b_small, "B_big": b_big}


class GradientNoiseScaleProbe(L.Callback):
    """Logs `probe/gns/*` every `every_n_steps` optimizer steps; never changes training."""

    def __init__(self, enabled: bool = False, every_n_steps: int = 1, ema_beta: float = 0.9) -> None:
        if every_n_steps < 1:
            raise ValueError(f"probe.gns.every_n_steps must be >= 1 (got {every_n_steps})")
        if not 0 <= ema_beta < 1:
            raise ValueError(f"probe.gns.ema_beta must be in [0, 1) (got {ema_beta})")
        self.enabled = enabled
        self.every_n_steps = every_n_steps
        self.ema_beta = ema_beta
        self.last_estimates: dict[str, float] = {}
        self._handles: list = []
        self._params: list[torch.nn.Parameter] = []
        self._active = False
        self._armed = False
        self._ema_tr = self._ema_g2 = 0.0
        self._ema_weight = 0.0
        self._warned = False
        self._reset_step()

    def check_setup(self, micro_batches_per_step: int, world_size: int) -> None:
        """A run configured so that no estimate can exist is a mistake: say so before training."""
        if self.enabled and micro_batches_per_step * world_size < 2:
            raise ValueError(
                "probe=[gns] needs two batch sizes, but each optimizer step is one micro-batch on one process: "
                "lower data.groups_per_micro_batch or trainer.accumulate_grad_batches, or train on several "
                "processes (trainer=ddp)"
            )

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._handles = [p.register_hook(functools.partial(self._on_grad, p)) for p in self._params]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._params = [], []

    def _reset_step(self) -> None:
        self._sum_sq = 0.0  # sum_i |g_i|^2 (own-loss scale)
        self._hook_total = 0.0  # |sum_i h_i|^2 (Lightning's scale), for the consistency ratio
        self._count = 0
        self._ess_sum = 0.0
        self._micro_sq: Tensor | float = 0.0  # |h_i|^2 of the running backward, on the gradients' device
        self._micro_cross: Tensor | float = 0.0  # <h_i, .grad before h_i>

    def _on_grad(self, param: torch.nn.Parameter, grad: Tensor) -> None:
        if self._armed:  # only the training backward; not e.g. another probe's torch.autograd.grad
            g = grad.detach().double()
            self._micro_sq = self._micro_sq + g.pow(2).sum()
            if param.grad is not None:
                self._micro_cross = self._micro_cross + (g * param.grad.detach().double()).sum()
        return None  # the gradient is never modified

    # ---- per micro-batch -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._active = self.enabled and trainer.global_step % self.every_n_steps == 0
        if self._active:
            self._micro_sq = self._micro_cross = 0.0
            self._batch_ess = effective_sample_size(pl_module.sample_weights(batch))

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._armed = self._active

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._armed = False
        if not self._active:
            return
        scale = float(trainer.accumulate_grad_batches)  # undo Lightning's loss / accumulate_grad_batches
        self._sum_sq += float(self._micro_sq) * scale**2
        self._hook_total += float(self._micro_sq) + 2.0 * float(self._micro_cross)
        self._count += 1
        self._ess_sum += self._batch_ess

    # ---- per optimizer step --------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._active:
            return
        big_sq = sum(float(p.grad.detach().double().pow(2).sum()) for p in self._params if p.grad is not None)
        totals = torch.tensor([self._sum_sq, self._count, self._ess_sum, self._hook_total], dtype=torch.float64)
        totals = trainer.strategy.reduce(totals.to(pl_module.device), reduce_op="sum").cpu()
        sum_sq, count, ess_sum, hook_total = totals.tolist()
        metrics = {"gns_G2_big": big_sq, "gns_ess": ess_sum / max(count, 1.0)}
        if trainer.world_size == 1 and big_sq > 0:
            metrics["gns_consistency_ratio"] = hook_total / big_sq
        estimates = gns_estimates(sum_sq, count, ess_sum, big_sq)
        if estimates:
            metrics.update(self._derived(estimates))
        elif not self._warned:
            log.warning("probe.gns: one micro-batch per step on one process: tr(S) and |G|^2 are not estimable")
            self._warned = True
        self.last_estimates = metrics
        pl_module.log_dict(
            {f"probe/gns/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=1
        )
        self._reset_step()

    def _derived(self, est: dict[str, float]) -> dict[str, float]:
        beta = self.ema_beta
        self._ema_tr = beta * self._ema_tr + (1 - beta) * est["tr_sigma"]
        self._ema_g2 = beta * self._ema_g2 + (1 - beta) * est["G2"]
        out = {"gns_tr_sigma": est["tr_sigma"], "gns_G2": est["G2"]}
        if est["G2"] > 0:
            out["gns_mu"] = est["tr_sigma"] / est["B_small"] / est["G2"]
            out["Bsimple_from_mu"] = out["gns_mu"] * est["B_small"]
        if self._ema_g2 > 0:
            out["B_simple"] = self._ema_tr / self._ema_g2
        return out
