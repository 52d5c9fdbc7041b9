"""Entropy probe: per-sequence policy entropy, its correlation with advantages, and how an update moves it.

Following Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv 2505.22617); what each metric estimates and how to read it: docs/probes.md.

- Token entropy H_t = -sum_v p(v|s_t) log p(v|s_t) of the sampling distribution (logits / temperature), taken
  from the training forward's own logits chunk by chunk as the chunked LM head computes them
  (`forward.completion_logprobs_with_entropy`: no second forward, no `[B, C, V]` tensor), in float64.
  Per-sequence entropy: mean over trained tokens. `token_mean`: mean over the step's trained tokens.
- `adv_corr`: Pearson correlation over sequences of (sequence entropy, advantage); with per-token advantages
  (STORPO's tree credit) a sequence's advantage is their mean over its trained tokens.
- `cov_logp_adv`: covariance over the step's trained tokens of (log p(y_t), A_t), centred by batch means (as
  verl's clip_cov). Cui's Lemma 1 (natural policy gradient, step eta): dH ~= -eta Cov(log p, A); logged as
  `projected_delta_cov` with eta = the current learning rate (Adam is not natural gradient: read its sign and
  trend, not its size).
- `projected_delta_first_order` (`first_order`, off by default: it costs a backward):
  grad_theta(token_mean) . delta_theta with delta_theta the actual optimizer update. The gradient of sum_t H_t
  with respect to the LM head's input comes with the entropies (one more `[n, V] x [V, H]` product per chunk);
  one extra backward from there
  (`torch.autograd.grad`, `.grad` untouched) gives the trainable parameters' part. The update is never copied:
  grad . theta is taken (in float64, exact products) before and after the optimizer step.
- `actual_delta` (`measure_actual`): mean entropy of the same micro-batches re-scored after the step (one extra
  forward per micro-batch) minus before. From the steps where it is not 0:
  `sign_agreement_cov` / `sign_agreement_first_order`, the running fraction of steps where that projection had
  the sign of the actual change (a projection of exactly 0 disagrees), and `corr_actual_cov` /
  `corr_actual_first_order`, the Pearson correlation across steps of the projection and the actual change
  (logged from 3 steps on).

Zero impact: every extra computation runs without touching `.grad`, and under `torch.random.fork_rng`.

DDP: each rank measures its own micro-batches (its entropy gradient is local, the update delta_theta global);
the logged values are the mean over ranks (`sync_dist`), NaN kept so every rank logs the same keys. The
(projection, actual) pairs that feed the agreement and correlation are averaged over ranks first, so every rank
keeps the same running statistics.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor

from grpo_lightning.accel.completion_forward import completion_logprobs_with_entropy
from grpo_lightning.accel.entropy_terms import entropy_and_logit_grad, token_entropy
from grpo_lightning.probes.base import ForwardNeed, ForwardProbe, ProbedModule

__all__ = ["EntropyProbe", "RunningAgreement", "entropy_and_logit_grad", "pearson", "token_entropy"]


def pearson(x: Tensor, y: Tensor) -> float:  # [N], [N]
    """Pearson correlation; NaN when either side has no spread."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float(x.pow(2).sum()) * float(y.pow(2).sum()))
    return float((x * y).sum()) / denom if denom > 0 else float("nan")


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)  # +0.0 and -0.0 are both 0 (math.copysign tells them apart)


def _dot64(a: Tensor, b: Tensor, block: int = 1 << 20) -> float:
    """sum(a * b) with float64 products and sums, a block at a time (float32 products are exact in float64)."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return sum(
        float(torch.dot(a[i : i + block].double(), b[i : i + block].double())) for i in range(0, a.numel(), block)
    )


class RunningAgreement:
    """Across steps: how often a projection has the sign of the actual change, and their Pearson correlation.

    Only steps whose actual change is not 0 count (no change has no sign to agree with). Constant memory.
    """

    def __init__(self) -> None:
        self.n = 0
        self.agree = 0
        self.sx = self.sy = self.sxx = self.syy = self.sxy = 0.0

    def update(self, projected: float, actual: float) -> None:
        if actual == 0 or not (math.isfinite(actual) and math.isfinite(projected)):
            return
        self.n += 1
        self.agree += int(_sign(projected) == _sign(actual))
        self.sx, self.sy = self.sx + projected, self.sy + actual
        self.sxx, self.syy, self.sxy = self.sxx + projected**2, self.syy + actual**2, self.sxy + projected * actual

    @property
    def sign_agreement(self) -> float:
        return self.agree / self.n if self.n else float("nan")

    @property
    def correlation(self) -> float:
        if self.n < 3:
            return float("nan")
        n = self.n
        cxx, cyy, cxy = self.sxx - self.sx**2 / n, self.syy - self.sy**2 / n, self.sxy - self.sx * self.sy / n
        return cxy / math.sqrt(cxx * cyy) if cxx > 0 and cyy > 0 else float("nan")


class EntropyProbe(ForwardProbe):
    """Logs `probe/entropy/*` every `every_n_steps` optimizer steps; never changes training."""

    def __init__(
        self,
        every_n_steps: int = 1,
        measure_actual: bool = False,
        first_order: bool = False,
        chunk_size: int = 2,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"probe.entropy.every_n_steps must be >= 1 (got {every_n_steps})")
        if chunk_size < 1:
            raise ValueError(f"probe.entropy.chunk_size must be >= 1 (got {chunk_size})")
        self.every_n_steps = every_n_steps
        self.measure_actual = measure_actual
        self.first_order = first_order
        self.chunk_size = chunk_size  # rows per chunk where a model's logits are materialised (plain forward)
        self.last_metrics: dict[str, float] = {}
        self._agreement = {"cov": RunningAgreement(), "first_order": RunningAgreement()}
        self._params: list[torch.nn.Parameter] = []
        self._active = False
        """Whether the running micro-batch's step is measured (`every_n_steps`)."""
        self._reset()

    def _reset(self) -> None:
        self._seq_entropy: list[Tensor] = []  # [B] per micro-batch
        self._advantages: list[Tensor] = []  # [B]
        self._cov_sums = {"n": 0.0, "logp": 0.0, "adv": 0.0, "logp_adv": 0.0}  # sums over trained tokens
        self._entropy_sum, self._tokens = 0.0, 0.0
        self._grad_h: list[Tensor] | None = None  # sum over micro-batches of grad_theta sum_t H_t
        self._dot_before = 0.0
        self._batches: list = []
        self._stepped = False

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: ProbedModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._params = [p for p in pl_module.parameters() if p.requires_grad]

    def teardown(self, trainer: L.Trainer, pl_module: ProbedModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._active = False
        self._params = []

    def on_train_batch_start(self, trainer, pl_module: ProbedModule, batch, batch_idx: int) -> None:
        self._active = trainer.global_step % self.every_n_steps == 0
        if self._active and self.measure_actual:
            self._batches.append(batch)

    # ---- per micro-batch (called from training_step with this forward's entropies) ------------------------
    def forward_need(self, batch) -> ForwardNeed | None:
        """The entropies of a measured step's micro-batches, with their gradient terms for `first_order`."""
        if not self._active:
            return None
        return "entropy_gradient" if self.first_order else "entropy"

    def observe_forward(self, batch, logp: Tensor, terms) -> None:  # [B, C], EntropyTerms
        mask = batch.completion_mask  # [B, C]
        entropy = terms.entropy * mask  # [B, C] float64
        tokens = mask.sum(-1)  # [B]
        self._seq_entropy.append((entropy.sum(-1) / tokens.clamp(min=1)).cpu())
        token_adv = batch.advantages_per_token.double()  # [B, C]
        if batch.token_advantages is None:
            self._advantages.append(batch.advantages.float().cpu())
        else:  # per-token credit: a sequence's advantage is the mean over its trained tokens
            self._advantages.append(((token_adv * mask).sum(-1) / tokens.clamp(min=1)).float().cpu())
        keep = mask.bool()
        lp = logp.detach()[keep].double()
        adv = token_adv[keep]
        sums = self._cov_sums
        sums["n"] += float(lp.numel())
        sums["logp"] += float(lp.sum())
        sums["adv"] += float(adv.sum())
        sums["logp_adv"] += float((lp * adv).sum())
        self._entropy_sum += float(entropy.sum())
        self._tokens += float(tokens.sum())
        if not self.first_order:
            return
        grads = torch.autograd.grad(terms.anchor, self._params, terms.anchor_grad, retain_graph=True, allow_unused=True)
        grads = list(grads)
        for param, head_grad in terms.head_grads:  # a trainable LM head's direct term (tied embeddings included)
            for k, p in enumerate(self._params):
                if p is param:
                    grads[k] = head_grad.to(p.dtype) if grads[k] is None else grads[k] + head_grad.to(grads[k].dtype)
        if self._grad_h is None:
            self._grad_h = [torch.zeros_like(p) if g is None else g for p, g in zip(self._params, grads, strict=True)]
        else:
            for acc, g in zip(self._grad_h, grads, strict=True):
                if g is not None:
                    acc.add_(g)

    # ---- per optimizer step --------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module: ProbedModule, optimizer) -> None:
        if not self._active or not self._seq_entropy:
            return
        self._stepped = True
        self._lr = optimizer.param_groups[0]["lr"]
        if self._grad_h is not None:
            self._dot_before = sum(_dot64(g, p) for g, p in zip(self._grad_h, self._params, strict=True))

    def on_train_batch_end(self, trainer, pl_module: ProbedModule, outputs, batch, batch_idx: int) -> None:
        if not self._stepped:  # not an optimizer step, or not probed
            return
        metrics = self._step_metrics()
        distributed = trainer.world_size > 1
        if self.measure_actual:
            metrics.update(self._actual(trainer, pl_module, metrics, distributed))
        self.last_metrics = metrics
        # every rank must log the same keys: NaN stays under DDP, averaged over ranks
        pl_module.log_dict(
            {f"probe/entropy/{k}": v for k, v in metrics.items() if distributed or not math.isnan(v)},
            on_step=True,
            on_epoch=False,
            batch_size=1,
            sync_dist=distributed,
        )
        self._active = False
        self._reset()

    def _step_metrics(self) -> dict[str, float]:
        seq = torch.cat(self._seq_entropy)  # [N]
        n, s_lp, s_adv, s_lp_adv = self._cov_sums.values()
        cov = s_lp_adv / n - (s_lp / n) * (s_adv / n) if n else float("nan")
        tokens = max(self._tokens, 1.0)
        metrics = {
            "seq_mean": float(seq.mean()),
            "seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
            "seq_min": float(seq.min()),
            "seq_max": float(seq.max()),
            "token_mean": self._entropy_sum / tokens,
            "adv_corr": pearson(seq, torch.cat(self._advantages)),
            "cov_logp_adv": cov,
            "projected_delta_cov": -self._lr * cov,
        }
        if self._grad_h is not None:
            dot_after = sum(_dot64(g, p) for g, p in zip(self._grad_h, self._params, strict=True))
            metrics["projected_delta_first_order"] = (dot_after - self._dot_before) / tokens
        return metrics

    @torch.no_grad()
    def _actual(
        self, trainer, pl_module: ProbedModule, metrics: dict[str, float], distributed: bool
    ) -> dict[str, float]:
        """Re-score the step's micro-batches with the updated policy: the entropy change the step caused."""
        total = 0.0
        with torch.random.fork_rng():
            for batch in self._batches:
                b = batch.to(pl_module.device)
                _, terms = completion_logprobs_with_entropy(
                    pl_module.policy,
                    b,
                    pl_module.temperature,
                    b.completion_mask,
                    pl_module.forward_settings.share_prefix,
                    pl_module.forward_settings.logits_chunk_tokens,
                    pl_module.forward_settings.runs_by_length,
                    with_grad=False,
                )
                total += float((terms.entropy * b.completion_mask).sum())
        actual = total / max(self._tokens, 1.0) - metrics["token_mean"]
        out = {"actual_delta": actual}
        for name in ("cov", "first_order"):
            projected = metrics.get(f"projected_delta_{name}")
            if projected is None:
                continue
            pair = torch.tensor([projected, actual], dtype=torch.float64)
            if distributed:  # every rank keeps the same running statistics
                pair = trainer.strategy.reduce(pair.to(pl_module.device), reduce_op="mean").cpu()
            running = self._agreement[name]
            running.update(*pair.tolist())
            out[f"sign_agreement_{name}"] = running.sign_agreement
            out[f"corr_actual_{name}"] = running.correlation
        return out
