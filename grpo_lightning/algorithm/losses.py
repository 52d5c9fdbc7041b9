"""GRPO policy loss: clipped surrogate (or CISPO's clipped IS weight) + k3 KL, TRL's `loss_type` aggregations.

Sources, and why each matters here:

* DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), GRPO: the per-token objective is the PPO clipped
  surrogate on a group-relative advantage `A_i`, minus `beta` times the k3 estimator of KL(pi || pi_ref),
  `exp(ref - logp) - (ref - logp) - 1`, which is unbiased and always >= 0.
* TRL `GRPOTrainer` (`loss_type` and `epsilon_low` / `epsilon_high` semantics): we keep TRL's names so configs
  transfer. What differs between the types (aggregation, clip rule, step normalisation, sample unit) is each
  type's own, in `loss_types.py`; this module keeps what they share.
* GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): a sequence-level ratio
  `s_i = exp(mean_t (logp - logp_old))`, clipped per completion (`importance_sampling_level: sequence`, TRL's
  name). With one advantage per completion this is also GSPO-token's value and gradient; the paper's clip range
  is tiny (3e-4 / 4e-4) because a mean of log-ratios moves far less than one token's. With per-token advantages
  (STORPO's tree credit) the ratio is GSPO-token's `s_it = sg(s_i) * pi_t / sg(pi_t)`: the value of `s_i` on
  every token, each token's gradient weighted by its own advantage (the paper's section 4.3).
* Advantages are one per completion (`[B]`, every trained token weighs by it) or one per token (`[B, T]`); a
  per-token tensor whose rows are constant gives the scalar path's loss and gradients.
* The rollout correction (`rollout_correction.py`) multiplies the policy-gradient term, never the KL term.

Pure tensor code: imports only torch and the standard library (no Lightning, no Hydra).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from grpo_lightning.algorithm.loss_options import check_options, config_problems
from grpo_lightning.algorithm.loss_types import LossType, LossTypeOptions, PolicyInputs, loss_type_problem
from grpo_lightning.algorithm.loss_types import loss_type as get_loss_type
from grpo_lightning.algorithm.rollout_correction import CorrectionWeights, RolloutCorrection
from grpo_lightning.schema import ConfigRules, check_settings, choice, integer, number, setting

IS_LEVELS = ("token", "sequence")


def entropy_bonus(value) -> str | None:
    """The rule of `loss.entropy_coef`: the weight of a bonus, >= 0. A negative value would minimise entropy (an
    entropy penalty, as entropy-minimisation objectives do), which the key does not offer: it is refused, not
    taken as a sign."""
    problem = number(low=0)(value)
    if problem is None:
        return None
    return (
        f"{problem}, the weight of an entropy bonus (the loss minus it x the entropy): a negative value would "
        "penalise entropy, which this key does not offer; 0 turns the bonus off"
    )


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
    """Reduce a per-token loss to a scalar the way `loss_type` does (`loss_types.py`).

    `num_tokens_in_step` (step-normalised types only, required there) is the trained-token count of the whole
    optimizer step; a step without trained tokens gives a zero loss instead of NaN.
    """
    weights = mask.to(per_token_loss.dtype)
    # torch.where, not a product, so a non-finite value at an untrained position cannot leak in as NaN.
    token_sum = torch.where(mask != 0, per_token_loss * weights, 0.0)
    return get_loss_type(loss_type).aggregate(token_sum, weights, max_completion_length, num_tokens_in_step)


@dataclass(frozen=True)
class MoveTerms:
    """Exact terms of the move distributions of a batch of positions (each [B], differentiable through `logq`)."""

    entropy: Tensor  # [B] H(pi) = -sum_k pi_k log pi_k, nats
    kl_reference: Tensor | None  # [B] KL(pi || pi_ref) = sum_k pi_k (log pi_k - log pi_ref_k); None: no reference
    kl_magnet: Tensor | None  # [B] KL(pi || magnet); None: no magnet


def move_terms(
    logq: Tensor,  # [B, K] log pi over each position's legal moves (-inf or anything off the mask)
    mask: Tensor,  # [B, K] bool, True on legal moves
    ref_logq: Tensor | None = None,  # [B, K] the reference's log-probs over the same moves
    magnet_logq: Tensor | None = None,  # [B, K] the magnet's log-probs over the same moves
) -> MoveTerms:
    """The entropy of each position's move distribution and its KL divergence to the reference and to the magnet,
    summed over the legal moves (exact: a move is one outcome, not a token sequence to estimate over; the
    magnetic mirror descent's regulariser, Sokota et al. 2022, arXiv 2206.05825). Moves off the mask weigh 0."""
    safe = torch.where(mask, logq, 0.0)  # [B, K] no -inf reaches a product
    pi = torch.where(mask, safe.exp(), 0.0)  # [B, K]

    def kl_to(other: Tensor | None) -> Tensor | None:
        if other is None:
            return None
        return (pi * (safe - torch.where(mask, other.to(safe.dtype), 0.0))).sum(dim=1)

    return MoveTerms(entropy=-(pi * safe).sum(dim=1), kl_reference=kl_to(ref_logq), kl_magnet=kl_to(magnet_logq))


@dataclass(frozen=True)
class LossOutput:
    """Scalar loss plus detached metrics of one micro-batch."""

    loss: Tensor  # [] differentiable
    kl_mean: Tensor  # [] masked token mean of k3 KL (0 when beta == 0 / no reference)
    clip_ratio: Tensor  # [] fraction of masked tokens (completions at sequence level) where clipping was active
    clip_ratio_low: Tensor  # [] fraction with ratio < 1 - epsilon_low and A < 0
    clip_ratio_high: Tensor  # [] fraction above the loss type's upper clip with A > 0 (`LossType.clip_masks`)
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
class GRPOLoss(LossTypeOptions, ConfigRules):
    """Clipped-surrogate GRPO loss with k3 KL; `__call__` maps one micro-batch's log-probs to `LossOutput`. The
    options of single loss types (`loss.<type>.*`) are declared with the types (`LossTypeOptions`), as are the
    values a type runs with only (`LossType.requires`)."""

    loss_type: str = setting("grpo", loss_type_problem)
    beta: float = setting(0.0, number(low=0))
    epsilon_low: float = setting(0.2, number(low=0, below=1))
    epsilon_high: float = setting(0.2, number(low=0))
    max_completion_length: int = setting(256, integer(1))
    importance_sampling_level: str = setting("token", choice(*IS_LEVELS))
    rollout_correction: RolloutCorrection = setting(factory=RolloutCorrection)
    entropy_coef: float = setting(0.0, entropy_bonus)
    magnet_coef: float = setting(0.0, number(low=0))

    def __post_init__(self) -> None:
        check_settings(self, "loss")
        check_options(self, self.kind)
        self.kind.check(self)

    @classmethod
    def check_config(cls, cfg) -> None:
        """The composed `loss` node against its loss type: another type's options, values it does not run with
        (`loss_options.py`: another preset with `loss.loss_type` changed keeps that preset's values)."""
        found = config_problems(cfg["loss"])
        if found:
            raise ValueError("; ".join(found))
        variant = cfg.get("variant") or {}
        if float(cfg["loss"].get("magnet_coef", 0.0)) != 0 and "magnet" not in variant:
            raise ValueError(
                "loss.magnet_coef pulls moves over the legal moves toward a magnet strategy: variant=selfplay with "
                "variant.move_policy=legal_moves and variant.magnet=uniform or snapshot (docs/selfplay.md)"
            )

    @property
    def kind(self) -> LossType:
        """The registered loss type `loss_type` names (`loss_types.py`)."""
        return get_loss_type(self.loss_type)

    def describe(self) -> str:
        """One line for the run's plan: the loss type, its ratio level, beta, the clip range, the rollout correction."""
        level = ", sequence-level ratio (GSPO)" if self.importance_sampling_level == "sequence" else ""
        c = self.rollout_correction
        correction = f"rollout correction {c.level} {c.mode}" if c.active else "no rollout correction"
        clip = f"epsilon {self.epsilon_low}/{self.epsilon_high}"
        return f"{self.loss_type}{level} (beta={self.beta}, {clip}; {correction})"

    def entropy_bonus(self, entropy_mean: Tensor, gradient_surrogate: Tensor) -> Tensor:  # []
        """The term the training step subtracts from the loss (TRL's `entropy_coef`): `entropy_coef` times the
        micro-batch's token-mean entropy of the temperature-scaled policy, whatever the loss type's aggregation.
        `entropy_mean` gives its value, `gradient_surrogate` (a scalar whose gradient is that of the mean) its
        gradient."""
        return self.entropy_coef * (entropy_mean.detach() + gradient_surrogate - gradient_surrogate.detach())

    def over_moves(self) -> GRPOLoss:
        """This loss for moves (one unit a position: the clipped surrogate of a move's probability over the legal
        moves, each move one 'token'); its KL, entropy and magnet terms are the module's exact ones (`move_terms`)."""
        return replace(self, beta=0.0, entropy_coef=0.0, magnet_coef=0.0, max_completion_length=1)

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probs are needed (beta > 0)."""
        return self.beta > 0

    @property
    def step_weighting(self) -> str:
        """How the optimizer step's gradient weighs micro-batches (the loss type's, `LossType.step_weighting`)."""
        return self.kind.step_weighting

    def step_loss(self, loss: Tensor, accumulate_grad_batches: int, world_size: int) -> Tensor:  # []
        """The micro-batch loss to backpropagate under Lightning's accumulation and DDP's gradient mean
        (`LossType.step_loss`)."""
        return self.kind.step_loss(loss, accumulate_grad_batches, world_size)

    def sample_weights(self, mask: Tensor) -> Tensor:  # mask [B, C] -> [B]
        """Weight of each completion in a micro-batch's loss, in the loss type's sample unit (GNS probe, ESS;
        `LossType.sample_weights`, grpo_lightning.probes.gns)."""
        return self.kind.sample_weights(mask)

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
        inputs = PolicyInputs(ratio=ratio, adv=adv, logp=logp, log_ratio=logp - old, weights=weights)
        per_token = self.kind.policy_term(inputs, self)
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
        above (TRL's `clip_ratio/low_mean`, `high_mean`; each loss type's rule, `LossType.clip_masks`)."""
        low, high = self.kind.clip_masks(ratio, adv, self.epsilon_low, self.epsilon_high)
        if ratio.shape[1] == 1:  # one value per completion: every completion counts, as in TRL
            return low.to(weights.dtype).mean(), high.to(weights.dtype).mean()
        return _masked_mean(low.to(weights.dtype), weights), _masked_mean(high.to(weights.dtype), weights)
