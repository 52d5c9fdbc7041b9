"""GRPO policy loss: clipped surrogate + k3 KL penalty, with TRL's four `loss_type` aggregations.

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

Pure tensor code: imports only torch and the standard library (no Lightning, no Hydra).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lightning.schema import check_settings, choice, integer, number, setting

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


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
    if loss_type == "dapo":
        if num_tokens_in_step is None:
            raise ValueError("loss_type 'dapo' needs num_tokens_in_step (trained tokens in the step)")
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
    clip_ratio: Tensor  # [] fraction of masked tokens where the clipped term was the active min
    clip_ratio_low: Tensor  # [] fraction with ratio < 1 - epsilon_low and A < 0
    clip_ratio_high: Tensor  # [] fraction with ratio > 1 + epsilon_high and A > 0
    num_tokens: Tensor  # [] masked (trained) token count


def _check_inputs(
    logp: Tensor,  # [B, T]
    old_logp: Tensor,  # [B, T]
    ref_logp: Tensor | None,  # [B, T]
    advantages: Tensor,  # [B]
    mask: Tensor,  # [B, T]
) -> None:
    shape = logp.shape
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T] (got {tuple(shape)})")
    for name, tensor in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(shape)} (got {tuple(tensor.shape)})")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(shape[:1])} (got {tuple(advantages.shape)})")


@dataclass(frozen=True)
class GRPOLoss:
    """Clipped-surrogate GRPO loss with k3 KL; `__call__` maps one micro-batch's log-probs to `LossOutput`."""

    loss_type: str = setting("grpo", choice(*LOSS_TYPES), "how token losses aggregate (docs/algorithm.md)")
    beta: float = setting(0.0, number(low=0), "weight of the k3 KL to the reference; 0 skips the reference forward")
    epsilon_low: float = setting(0.2, number(low=0, below=1), "clip range below 1")
    epsilon_high: float = setting(0.2, number(low=0), "clip range above 1 (DAPO's clip-higher: 0.28)")
    max_completion_length: int = setting(256, integer(1), "the constant of dr_grpo's denominator")

    def __post_init__(self) -> None:
        check_settings(self, "loss")

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probs are needed (beta > 0)."""
        return self.beta > 0

    @property
    def step_weighting(self) -> str:
        """How the optimizer step's gradient weighs micro-batches: "micro_batch" (Lightning's mean over them) or
        "sample" (`dapo`: the step is the mean over all its completions' tokens, see `step_loss`)."""
        return "sample" if self.loss_type == "dapo" else "micro_batch"

    def step_loss(self, loss: Tensor, accumulate_grad_batches: int, world_size: int) -> Tensor:  # []
        """The micro-batch loss to backpropagate under Lightning's accumulation and DDP's gradient mean.

        Lightning divides each loss by `accumulate_grad_batches` and DDP averages gradients over ranks: right for
        a mean of per-micro-batch losses (`grpo`, `bnpo`, `dr_grpo`, as TRL does), but `dapo` is already
        normalised by the token count of the whole step (all micro-batches, all ranks), so both are undone.
        """
        if self.loss_type == "dapo":
            return loss * accumulate_grad_batches * world_size
        return loss

    def sample_weights(self, mask: Tensor) -> Tensor:  # mask [B, C] -> [B]
        """Weight of each completion in a micro-batch's loss, in the loss type's sample unit (GNS probe, ESS).

        `grpo` (token means), `dr_grpo` (token sums / max length) and `dapo` (token sums / the step's mean
        length) average one value per completion with equal weights, every row counted (a row without trained
        tokens contributes 0, and the loss still divides by it); `bnpo`'s token mean weighs each completion's
        token mean by its trained tokens. See `grpo_lightning.probes.gns`.
        """
        if self.loss_type == "bnpo":
            return mask.sum(-1).float()
        return torch.ones(mask.shape[0], device=mask.device)

    def __call__(
        self,
        logp: Tensor,  # [B, T] policy log-probs (differentiable)
        old_logp: Tensor,  # [B, T] log-probs of the sampling policy (may be logp.detach())
        ref_logp: Tensor | None,  # [B, T] reference log-probs; None allowed only when beta == 0
        advantages: Tensor,  # [B]
        mask: Tensor,  # [B, T] 1 = trained token
        num_tokens_in_step: float | int | None = None,
    ) -> LossOutput:
        if self.needs_reference and ref_logp is None:
            raise ValueError(f"ref_logp is required when loss.beta > 0 (got beta={self.beta!r})")
        _check_inputs(logp, old_logp, ref_logp, advantages, mask)
        keep = mask != 0
        weights = mask.to(logp.dtype)
        # Untrained positions are replaced by 0 up front: ratio 1, KL 0, finite values and an exact zero
        # gradient there, whatever garbage (e.g. padding log-probs) they held.
        logp = torch.where(keep, logp, 0.0)
        old_logp = torch.where(keep, old_logp.to(logp.dtype), 0.0)
        adv = advantages.to(logp.dtype).unsqueeze(1)
        ratio = torch.exp(logp - old_logp)
        clipped = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        kl_mean = logp.new_zeros(())
        if self.needs_reference:
            kl = k3_kl(logp, torch.where(keep, ref_logp.to(logp.dtype), 0.0))
            per_token = per_token + self.beta * kl
            kl_mean = _masked_mean(kl.detach(), weights)
        loss = aggregate(per_token, mask, self.loss_type, self.max_completion_length, num_tokens_in_step)
        with torch.no_grad():
            low = _masked_mean(((ratio < 1.0 - self.epsilon_low) & (adv < 0)).to(logp.dtype), weights)
            high = _masked_mean(((ratio > 1.0 + self.epsilon_high) & (adv > 0)).to(logp.dtype), weights)
        return LossOutput(
            loss=loss,
            kl_mean=kl_mean,
            clip_ratio=low + high,
            clip_ratio_low=low,
            clip_ratio_high=high,
            num_tokens=weights.sum().detach(),
        )
