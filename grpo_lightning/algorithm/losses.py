"""GRPO policy loss: clipped surrogate (or CISPO's clipped IS weight) + k3 KL, TRL's `loss_type` aggregations.

Sources, and why each matters here:

* DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), GRPO: the per-token objective is the PPO clipped
  surrogate on a group-relative advantage `A_i`, minus `beta` times the k3 estimator of KL(pi || pi_ref),
  `exp(ref - logp) - (ref - logp) - 1`, which is unbiased and always >= 0.
* TRL `GRPOTrainer` (`loss_type` and `epsilon_low` / `epsilon_high` semantics): `grpo` averages each
  sequence over its own length and then over sequences (longer answers get less weight per token); `bnpo`
  averages over all trained tokens of the micro-batch. We keep TRL's names so configs transfer.
* Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): dividing by the sequence length biases training toward
  long wrong answers, so `dr_grpo` divides the token sum by the CONSTANT `N_seq * max_completion_length`.
* DAPO (Yu et al. 2025, arXiv 2503.14476): token-level normalisation over the whole batch, plus the
  decoupled, asymmetric clip range (`epsilon_high > epsilon_low`, "clip-higher").
* TRL issue #3021: with gradient accumulation, normalising each micro-batch by its own token count is not
  the token mean of the full batch. `dapo` therefore divides by `num_tokens_in_step`, the trained-token
  count of the whole optimizer step (all micro-batches, all ranks), so the micro-batch losses sum to the
  full-batch loss.
* GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): a sequence-level ratio
  `s_i = exp(mean_t (logp - logp_old))`, clipped per completion (`importance_sampling_level: sequence`, TRL's
  name). With one advantage per completion this is also GSPO-token's value and gradient; the paper's clip range
  is tiny (3e-4 / 4e-4) because a mean of log-ratios moves far less than one token's. With per-token advantages
  (STORPO's tree credit) the ratio is GSPO-token's `s_it = sg(s_i) * pi_t / sg(pi_t)`: the value of `s_i` on
  every token, each token's gradient weighted by its own advantage (the paper's section 4.3).
* Advantages are one per completion (`[B]`, every trained token weighs by it) or one per token (`[B, T]`); a
  per-token tensor whose rows are constant gives the scalar path's loss and gradients.
* CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv
  2506.13585): `-sg(min(rho, epsilon_high)) * A * logp`. The IS weight is clipped, not the update, so every token
  keeps a gradient (PPO's clip zeroes those outside the range). As in TRL, `epsilon_high` is the cap of the
  weight itself (ScaleRL, arXiv 2510.13786: 5.0), and the token sum is divided like `dapo`'s.
* The rollout correction (`rollout_correction.py`) multiplies the policy-gradient term, never the KL term.

Pure tensor code: imports only torch and the standard library (no Lightning, no Hydra).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lightning.algorithm.rollout_correction import CorrectionWeights, RolloutCorrection
from grpo_lightning.schema import check_settings, choice, integer, number, setting

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IS_LEVELS = ("token", "sequence")
STEP_NORMALISED = ("dapo", "cispo")
"""Loss types divided by the trained tokens of the whole optimizer step (TRL: `num_items_in_batch`)."""


def selective_log_softmax(
    logits: Tensor,  # [B, T, V] any float dtype
    index: Tensor,  # [B, T] long
    chunk_size: int = 4,
) -> Tensor:  # [B, T] float32
    """`log_softmax(logits)[..., index]` in float32, `chunk_size` rows of B at a time.

    Computed as `gather(logits) - logsumexp(logits)` per chunk, so the full `[B, T, V]` log-softmax (and a
    full float32 copy of bf16 logits) is never materialised at once. Differentiable.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (got {chunk_size!r})")
    if logits.dim() != 3 or index.shape != logits.shape[:2]:
        raise ValueError(
            f"selective_log_softmax expects logits [B, T, V] and index [B, T] "
            f"(got {tuple(logits.shape)} and {tuple(index.shape)})"
        )
    if logits.shape[0] == 0:
        return logits.new_zeros(index.shape, dtype=torch.float32)
    rows = []
    for chunk_logits, chunk_index in zip(logits.split(chunk_size), index.split(chunk_size), strict=True):
        chunk32 = chunk_logits.float()
        picked = chunk32.gather(-1, chunk_index.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(chunk32, dim=-1))
    return torch.cat(rows)


def k3_kl(
    logp: Tensor,  # [B, T]
    ref_logp: Tensor,  # [B, T]
) -> Tensor:  # [B, T]
    """k3 estimator of KL(pi || pi_ref) per token: `exp(d) - d - 1` with `d = ref_logp - logp` (>= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def _masked_mean(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] float
) -> Tensor:  # []
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(
    per_token_loss: Tensor,  # [B, T]
    mask: Tensor,  # [B, T] 1 = trained token (bool, int or float)
    loss_type: str,
    max_completion_length: int,
    num_tokens_in_step: float | int | None = None,
) -> Tensor:  # []
    """Reduce a per-token loss to a scalar according to `loss_type` (see the module docstring).

    `num_tokens_in_step` (dapo only, required there) is the trained-token count of the whole optimizer step;
    it is clamped to >= 1 so a step without trained tokens gives a zero loss instead of NaN.
    """
    weights = mask.to(per_token_loss.dtype)
    # torch.where, not a product, so a non-finite value at an untrained position cannot leak in as NaN.
    token_sum = torch.where(mask != 0, per_token_loss * weights, 0.0)
    if loss_type == "grpo":
        return (token_sum.sum(-1) / weights.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return token_sum.sum() / weights.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return token_sum.sum() / (per_token_loss.shape[0] * max_completion_length)
    if loss_type in STEP_NORMALISED:
        if num_tokens_in_step is None:
            raise ValueError(f"loss_type {loss_type!r} needs num_tokens_in_step (trained tokens in the step)")
        num_tokens = float(num_tokens_in_step)
        if not num_tokens >= 0:
            raise ValueError(f"num_tokens_in_step must be >= 0 (got {num_tokens_in_step!r})")
        return token_sum.sum() / max(num_tokens, 1.0)
    raise ValueError(f"loss.loss_type must be one of {', '.join(LOSS_TYPES)} (got {loss_type!r})")


@dataclass(frozen=True)
class LossOutput:
    """Scalar loss plus detached metrics of one micro-batch."""

    loss: Tensor  # [] differentiable
    kl_mean: Tensor  # [] masked token mean of k3 KL (0 when beta == 0 / no reference)
    clip_ratio: Tensor  # [] fraction of masked tokens (completions at sequence level) where clipping was active
    clip_ratio_low: Tensor  # [] fraction with ratio < 1 - epsilon_low and A < 0
    clip_ratio_high: Tensor  # [] fraction with ratio > 1 + epsilon_high (cispo: > epsilon_high) and A > 0
    num_tokens: Tensor  # [] masked (trained) token count
    correction: CorrectionWeights | None = None
    """The rollout correction's weights and metrics; None when it is off."""


def _check_inputs(
    logp: Tensor,  # [B, T]
    old_logp: Tensor,  # [B, T]
    ref_logp: Tensor | None,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T]
) -> None:
    shape = logp.shape
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T] (got {tuple(shape)})")
    for name, tensor in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(shape)} (got {tuple(tensor.shape)})")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be [B] = {tuple(shape[:1])} or [B, T] = {tuple(shape)} (got {tuple(advantages.shape)})"
        )


@dataclass(frozen=True)
class GRPOLoss:
    """Clipped-surrogate GRPO loss with k3 KL; `__call__` maps one micro-batch's log-probs to `LossOutput`."""

    loss_type: str = setting("grpo", choice(*LOSS_TYPES))
    beta: float = setting(0.0, number(low=0))
    epsilon_low: float = setting(0.2, number(low=0, below=1))
    epsilon_high: float = setting(0.2, number(low=0))
    max_completion_length: int = setting(256, integer(1))
    importance_sampling_level: str = setting("token", choice(*IS_LEVELS))
    rollout_correction: RolloutCorrection = setting(factory=RolloutCorrection)

    def __post_init__(self) -> None:
        check_settings(self, "loss")
        if self.loss_type == "cispo" and self.epsilon_high < 1:
            raise ValueError(
                f"loss.epsilon_high must be >= 1 for loss_type cispo, where it caps the IS weight itself (TRL's "
                f"convention; ScaleRL: 5.0) (got {self.epsilon_high!r})"
            )

    def describe(self) -> str:
        """One line for the run's plan: the loss type, its ratio level, beta, the clip range, the rollout correction."""
        level = ", sequence-level ratio (GSPO)" if self.importance_sampling_level == "sequence" else ""
        c = self.rollout_correction
        correction = f"rollout correction {c.level} {c.mode}" if c.active else "no rollout correction"
        clip = f"epsilon {self.epsilon_low}/{self.epsilon_high}"
        return f"{self.loss_type}{level} (beta={self.beta}, {clip}; {correction})"

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probs are needed (beta > 0)."""
        return self.beta > 0

    @property
    def step_weighting(self) -> str:
        """How the optimizer step's gradient weighs micro-batches: "micro_batch" (Lightning's mean over them) or
        "sample" (`dapo`, `cispo`: the step is the mean over all its completions' tokens, see `step_loss`)."""
        return "sample" if self.loss_type in STEP_NORMALISED else "micro_batch"

    def step_loss(self, loss: Tensor, accumulate_grad_batches: int, world_size: int) -> Tensor:  # []
        """The micro-batch loss to backpropagate under Lightning's accumulation and DDP's gradient mean.

        Lightning divides each loss by `accumulate_grad_batches` and DDP averages gradients over ranks: right for
        a mean of per-micro-batch losses (`grpo`, `bnpo`, `dr_grpo`, as TRL does), but `dapo` and `cispo` are
        already normalised by the token count of the whole step (all micro-batches, all ranks), so both are undone.
        """
        if self.loss_type in STEP_NORMALISED:
            return loss * accumulate_grad_batches * world_size
        return loss

    def sample_weights(self, mask: Tensor) -> Tensor:  # mask [B, C] -> [B]
        """Weight of each completion in a micro-batch's loss, in the loss type's sample unit (GNS probe, ESS).

        `grpo` (token means), `dr_grpo` (token sums / max length) and `dapo` / `cispo` (token sums / the step's
        mean length) average one value per completion with equal weights, every row counted (a row without trained
        tokens contributes 0, and the loss still divides by it); `bnpo`'s token mean weighs each completion's
        token mean by its trained tokens. See `grpo_lightning.probes.gns`.
        """
        if self.loss_type == "bnpo":
            return mask.sum(-1).float()
        return torch.ones(mask.shape[0], device=mask.device)

    def __call__(
        self,
        logp: Tensor,  # [B, T] policy log-probs (differentiable)
        old_logp: Tensor,  # [B, T] the trainer's log-probs before the update (may be logp.detach())
        ref_logp: Tensor | None,  # [B, T] reference log-probs; None allowed only when beta == 0
        advantages: Tensor,  # [B] one per completion, or [B, T] one per token
        mask: Tensor,  # [B, T] 1 = trained token
        num_tokens_in_step: float | int | None = None,
        gen_logp: Tensor | None = None,  # [B, T] the generator's log-probs; needed when the rollout correction is on
    ) -> LossOutput:
        if self.needs_reference and ref_logp is None:
            raise ValueError(f"ref_logp is required when loss.beta > 0 (got beta={self.beta!r})")
        correcting = self.rollout_correction.active
        if correcting and gen_logp is None:
            raise ValueError("gen_logp (the generator's log-probs) is required when loss.rollout_correction is on")
        _check_inputs(logp, old_logp, ref_logp, advantages, mask)
        keep = mask != 0
        weights = mask.to(logp.dtype)
        # Untrained positions are replaced by 0 up front: ratio 1, KL 0, finite values and an exact zero
        # gradient there, whatever garbage (e.g. padding log-probs) they held.
        logp = torch.where(keep, logp, 0.0)
        per_token_adv = advantages.dim() == 2
        if per_token_adv:
            adv = torch.where(keep, advantages.to(logp.dtype), 0.0)  # [B, T]
        else:
            adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
        old = torch.where(keep, old_logp.to(logp.dtype), 0.0)
        ratio = self.ratio(logp, old, weights, per_token_sequence=per_token_adv)  # [B, T] or [B, 1]
        if self.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=self.epsilon_high).detach() * adv * logp
        else:
            clipped = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
            per_token = -torch.minimum(ratio * adv, clipped * adv)
        correction = self.rollout_correction.weights(old_logp, gen_logp, mask) if correcting else None
        if correction is not None:  # the policy-gradient term only, never the KL term (rollout_correction.py)
            per_token = per_token * correction.weight.to(logp.dtype)
        per_token = per_token.expand_as(logp)  # [B, T]: a sequence-level term is the same on every token
        kl_mean = logp.new_zeros(())
        if self.needs_reference:
            kl = k3_kl(logp, torch.where(keep, ref_logp.to(logp.dtype), 0.0))
            per_token = per_token + self.beta * kl
            kl_mean = _masked_mean(kl.detach(), weights)
        loss = aggregate(per_token, mask, self.loss_type, self.max_completion_length, num_tokens_in_step)
        low, high = self.clip_fractions(ratio.detach(), adv, weights)
        return LossOutput(
            loss=loss,
            kl_mean=kl_mean,
            clip_ratio=low + high,
            clip_ratio_low=low,
            clip_ratio_high=high,
            num_tokens=weights.sum().detach(),
            correction=correction,
        )

    def ratio(
        self,
        logp: Tensor,  # [B, T] 0 on untrained tokens
        old_logp: Tensor,  # [B, T] 0 on untrained tokens
        weights: Tensor,  # [B, T] 1.0 on trained tokens
        per_token_sequence: bool = False,
    ) -> Tensor:  # [B, T] (token level, GSPO-token) or [B, 1] (sequence level: GSPO's s_i)
        """pi_theta / pi_old per token, or GSPO's per completion: exp of the mean log-ratio over its trained tokens.

        `per_token_sequence` (per-token advantages at sequence level): GSPO-token's `sg(s_i) * exp(logp - sg(logp))`
        on every token, whose value is `s_i` and whose gradient reaches each token through its own term."""
        log_ratio = logp - old_logp
        if self.importance_sampling_level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp(min=1.0)
            if per_token_sequence:
                return torch.exp(log_ratio).detach() * torch.exp(logp - logp.detach())
        return torch.exp(log_ratio)

    def clip_fractions(
        self,
        ratio: Tensor,  # [B, T] or [B, 1]
        adv: Tensor,  # [B, 1] or [B, T]
        weights: Tensor,  # [B, T]
    ) -> tuple[Tensor, Tensor]:  # ([], [])
        """Fractions of trained tokens (of completions, at sequence level) where clipping was active, below and
        above (TRL's `clip_ratio/low_mean`, `high_mean`; cispo: the weight capped at `epsilon_high`, A > 0)."""
        if self.loss_type == "cispo":
            low, high = torch.zeros_like(ratio, dtype=torch.bool), (ratio > self.epsilon_high) & (adv > 0)
        else:
            low, high = (ratio < 1.0 - self.epsilon_low) & (adv < 0), (ratio > 1.0 + self.epsilon_high) & (adv > 0)
        if ratio.shape[1] == 1:  # one value per completion: every completion counts, as in TRL
            return low.to(weights.dtype).mean(), high.to(weights.dtype).mean()
        return _masked_mean(low.to(weights.dtype), weights), _masked_mean(high.to(weights.dtype), weights)
