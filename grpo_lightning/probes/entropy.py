"""Entropy probe: per-sequence policy entropy, its correlation with advantages, and how an update moves it.

Following Cui et al. 2025 ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617) and seed 002:

- Token entropy H_t = -sum_v p(v|s_t) log p(v|s_t) of the sampling distribution (logits / temperature), taken
  from the training forward's own logits (the module hands them over on probed steps: no second forward), row
  chunk by row chunk so no extra [B, T, V] tensor is held at once. Per-sequence entropy: mean over trained tokens.
- `adv_corr`: Pearson correlation over sequences of (sequence entropy, advantage).
- `cov_logp_adv`: covariance over the step's trained tokens of (log p(y_t), A_t), centred by batch means (as
  verl's clip_cov). Cui's Lemma 1 (natural policy gradient, step eta): dH ~= -eta Cov(log p, A); logged as
  `projected_delta_cov` with eta = the current learning rate (Adam is not natural gradient: read its sign and
  trend, not its size). A positive covariance (confident tokens rewarded, unlikely ones penalised) predicts an
  entropy drop, the mechanism of entropy collapse; a negative one predicts entropy growth.
- `projected_delta_first_order`: grad_theta(H) . delta_theta with delta_theta the actual optimizer update.
  grad_theta(H) is one extra backward from the training forward's logits: dH_t/dl = -p (log p + H_t) is built
  chunk by chunk and pulled back with `torch.autograd.grad` (never touching `.grad`).
- `actual_delta` (opt-in, `measure_actual`): mean entropy of the same micro-batches re-scored after the step
  (one extra forward per micro-batch). `sign_agreement` / `sign_agreement_first_order`: running fraction of
  steps where a projection had the sign of the actual change.

Zero impact: every extra computation runs without touching `.grad`, and under `torch.random.fork_rng`.

DDP: each rank measures its own micro-batches (its entropy gradient is local, the update delta_theta global);
the logged values are the mean over ranks (`sync_dist`), NaN kept so every rank logs the same keys.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor


@torch.no_grad()
def token_entropy(logits: Tensor, chunk_size: int = 2, dtype: torch.dtype = torch.float64) -> Tensor:
    """Entropy of softmax(logits) per position: [B, T, V] -> [B, T], `chunk_size` rows at a time.

    float64 by default: entropy changes of one small step (~1e-6 nats) are below float32 resolution of a sum
    of ~10-nat entropies. Peak extra memory: chunk_size x T x V x 8 bytes.
    """
    rows = []
    for chunk in logits.detach().split(chunk_size):
        logp = torch.log_softmax(chunk.to(dtype), dim=-1)  # [b, T, V]
        rows.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(rows)


@torch.no_grad()
def entropy_logit_grad(logits: Tensor, weights: Tensor, chunk_size: int = 4) -> Tensor:  # [B, T, V], [B, T]
    """d(sum_t weights_t H_t) / d logits = -weights_t p (log p + H_t), in the logits' dtype, chunk by chunk.

    Computed in at least float32; this tensor is the one extra [B, T, V] buffer the first-order projection needs.
    """
    out = torch.empty_like(logits)
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size]
        logp = torch.log_softmax(chunk.to(torch.promote_types(chunk.dtype, torch.float32)), dim=-1)  # [b, T, V]
        p = logp.exp()
        h = -(p * logp).sum(-1, keepdim=True)  # [b, T, 1]
        w = weights[start : start + chunk_size].unsqueeze(-1)
        out[start : start + chunk_size] = (-w * p * (logp + h)).to(logits.dtype)
    return out


def pearson(x: Tensor, y: Tensor) -> float:  # [N], [N]
    """Pearson correlation; NaN when either side has no spread."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float(x.pow(2).sum()) * float(y.pow(2).sum()))
    return float((x * y).sum()) / denom if denom > 0 else float("nan")


class EntropyProbe(L.Callback):
    """Logs `probe/entropy/*` every `every_n_steps` optimizer steps; never changes training."""

    def __init__(
        self, enabled: bool = False, every_n_steps: int = 1, measure_actual: bool = False, chunk_size: int = 2
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"probe.entropy.every_n_steps must be >= 1 (got {every_n_steps})")
        if chunk_size < 1:
            raise ValueError(f"probe.entropy.chunk_size must be >= 1 (got {chunk_size})")
        self.enabled = enabled
        self.every_n_steps = every_n_steps
        self.measure_actual = measure_actual
        self.chunk_size = chunk_size
        self.last_metrics: dict[str, float] = {}
        self._agree = {"cov": [0, 0], "first_order": [0, 0]}  # [agreeing steps, steps with an actual change]
        self._module = None
        self._reset()

    def _reset(self) -> None:
        self._seq_entropy: list[Tensor] = []  # [B] per micro-batch
        self._advantages: list[Tensor] = []  # [B]
        self._token_logp: list[Tensor] = []  # [n] trained tokens
        self._token_adv: list[Tensor] = []  # [n]
        self._entropy_sum, self._tokens = 0.0, 0.0
        self._grad_h: list[Tensor] | None = None  # sum over micro-batches of grad_theta sum_t H_t
        self._batches: list = []
        self._before: list[Tensor] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._module = pl_module
        self._params = [p for p in pl_module.parameters() if p.requires_grad]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.logits_observer = None
        self._params = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        active = self.enabled and trainer.global_step % self.every_n_steps == 0
        pl_module.logits_observer = self._observe if active else None
        if active and self.measure_actual:
            self._batches.append(batch)

    # ---- per micro-batch (called from training_step with the live logits) ----------------------------------
    def _observe(self, logits: Tensor, logp: Tensor, batch) -> None:  # [B, C, V], [B, C]
        mask = batch.completion_mask  # [B, C]
        entropy = token_entropy(logits, self.chunk_size) * mask  # [B, C]
        tokens = mask.sum(-1)  # [B]
        self._seq_entropy.append((entropy.sum(-1) / tokens.clamp(min=1)).cpu())
        self._advantages.append(batch.advantages.float().cpu())
        keep = mask.bool()
        self._token_logp.append(logp.detach()[keep].float().cpu())
        self._token_adv.append(batch.advantages[:, None].expand_as(mask)[keep].float().cpu())
        self._entropy_sum += float(entropy.sum())
        self._tokens += float(tokens.sum())
        grad_logits = entropy_logit_grad(logits.detach(), mask, self.chunk_size)  # [B, C, V]
        grads = torch.autograd.grad(logits, self._params, grad_logits, retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self._params, grads, strict=True)]
        if self._grad_h is None:
            self._grad_h = grads
        else:
            self._grad_h = [a + g for a, g in zip(self._grad_h, grads, strict=True)]

    # ---- per optimizer step --------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if pl_module.logits_observer is None or not self._seq_entropy:
            return
        self._before = [p.detach().clone() for p in self._params]
        self._lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._before is None:  # not an optimizer step, or not probed
            return
        metrics = self._step_metrics()
        if self.measure_actual:
            metrics.update(self._actual(pl_module, metrics))
        self.last_metrics = metrics
        distributed = trainer.world_size > 1  # every rank must log the same keys: NaN stays, averaged over ranks
        pl_module.log_dict(
            {f"probe/entropy/{k}": v for k, v in metrics.items() if distributed or not math.isnan(v)},
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=distributed,
        )
        pl_module.logits_observer = None
        self._reset()

    def _step_metrics(self) -> dict[str, float]:
        seq = torch.cat(self._seq_entropy)  # [N]
        logp, adv = torch.cat(self._token_logp).double(), torch.cat(self._token_adv).double()  # [n], [n]
        cov = float(((logp - logp.mean()) * (adv - adv.mean())).mean()) if logp.numel() else float("nan")
        tokens = max(self._tokens, 1.0)
        delta = [p.detach() - b for p, b in zip(self._params, self._before, strict=True)]
        first_order = sum(float((g.double() * d.double()).sum()) for g, d in zip(self._grad_h, delta, strict=True))
        return {
            "seq_mean": float(seq.mean()),
            "seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
            "seq_min": float(seq.min()),
            "seq_max": float(seq.max()),
            "token_mean": self._entropy_sum / tokens,
            "adv_corr": pearson(seq, torch.cat(self._advantages)),
            "cov_logp_adv": cov,
            "projected_delta_cov": -self._lr * cov,
            "projected_delta_first_order": first_order / tokens,
        }

    @torch.no_grad()
    def _actual(self, pl_module, metrics: dict[str, float]) -> dict[str, float]:
        """Re-score the step's micro-batches with the updated policy: the entropy change the step caused."""
        total = 0.0
        with torch.random.fork_rng():
            for batch in self._batches:
                b = batch.to(pl_module.device)
                logits, _ = pl_module.policy_forward(pl_module.policy, b, with_logits=True)
                total += float((token_entropy(logits, self.chunk_size) * b.completion_mask).sum())
        actual = total / max(self._tokens, 1.0) - metrics["token_mean"]
        out = {"actual_delta": actual}
        for name, key in (("cov", "projected_delta_cov"), ("first_order", "projected_delta_first_order")):
            agree = self._agree[name]
            agree[0] += int(math.copysign(1, metrics[key]) == math.copysign(1, actual))
            agree[1] += 1
            out["sign_agreement" if name == "cov" else "sign_agreement_first_order"] = agree[0] / agree[1]
        return out
