"""Rollout correction: importance weights of the policy-gradient term against the generator's log-probs.

The loss's ratio `pi_theta / pi_old` assumes the completions were sampled from pi_old, the trainer's policy before
the update. They were sampled by the generator, pi_gen, which is pi_old only up to the engine: another dtype (a
bf16 vLLM engine beside a float32 or autocast trainer), other kernels, weights a round or more stale
(`generator.sync_every` > 1, overlapped rounds). `rollout/logp_diff_*` measures the gap; this module corrects it
with the per-token ratio `rho_t = pi_old(o_t) / pi_gen(o_t) = exp(logp_old_t - logp_gen_t)`, a constant
(stop-gradient) weight on each token's policy-gradient term:

* TIS, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): `w = min(rho, cap)`. Truncation bounds the variance that a rare token the engine
  under-sampled would bring; the bias it leaves is small while the cap is rarely hit (`train/is_capped_frac`).
* MIS, masked importance sampling (IcePop: Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
  Trillion-Scale Thinking Model", arXiv 2510.18855; TRL's `vllm_importance_sampling_mode="*_mask"`):
  `w = rho` inside `[low, high]` and 0 outside, so a token (or a completion) on which the two policies disagree
  by more than that trains on nothing rather than on a clipped value.
* Level: `token` weighs each token by its own ratio; `sequence` weighs every token of a completion by the ratio
  of the whole completion, the product over its trained tokens `exp(sum_t (logp_old_t - logp_gen_t))`, which is
  the unbiased weight of a sequence-level reward and has a far larger spread (Liu, Li et al. 2025, "When Speed
  Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch").

Placement: the weight multiplies the per-token policy-gradient term only, never the KL penalty: the KL to the
reference is a regulariser of pi_theta, not an expectation over the engine's samples (verl's rollout correction,
`compute_policy_loss_*` in verl/trainer/ppo/core_algos.py: `pg_losses = pg_losses * rollout_is_weights`, the KL
loss added apart; TRL's GRPOTrainer multiplies `per_token_loss` by its ratio before adding `beta * per_token_kl`).

`enabled: auto` turns the correction on exactly where the generator is known to differ from pi_old
(`correction_needed`): rounds that overlap, an engine computing in another dtype than the trainer, or weights
pushed to the engine less than every round. Where they agree (the HF engine sampling from the policy itself) the
ratio is 1 up to float rounding and the correction is left off.

Log-ratios are bounded to [-20, 20] before the exponential (verl's safety bound) so a sequence-level product
cannot overflow; a NaN generator log-prob (unavailable) counts as agreement, ratio 1, as TRL does.
Pure tensor code: imports only torch and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lightning.schema import check_settings, choice, integer, number, optional, setting

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
LOG_RATIO_BOUND = 20.0


def switch(value) -> str | None:
    return None if value == "auto" or isinstance(value, bool) else "must be auto, true or false"


def dtype_name(value) -> str | None:
    return None if isinstance(value, str) else "must be a dtype name (float32, bfloat16, float16) or auto"


def precision_name(value) -> str | None:
    return None if isinstance(value, str | int) and not isinstance(value, bool) else "must be a Lightning precision"


def trainer_compute_dtype(model_dtype: str, trainer_precision: str | int) -> str:
    """The dtype the training forward computes in: autocast's under a mixed or half precision, else the weights'."""
    precision = str(trainer_precision)
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    if precision.startswith("64"):
        return "float64"
    if precision.startswith("transformer-engine"):
        return "float8"
    return model_dtype


def correction_needed(
    max_staleness: int | None, sync_every: int, engine_dtype: str | None, model_dtype: str, trainer_precision: str | int
) -> bool:
    """Whether the generator samples from another policy than the trainer's pi_old, from the config alone.

    Another policy when rounds overlap (a rollout may lag the weights by up to `max_staleness` rounds; None: 0),
    when the engine gets the weights only every `sync_every` rounds, or when the engine computes in another dtype
    than the trainer (`engine_dtype` `auto` or None: the policy's own, `model_dtype`; the trainer computes in
    autocast's dtype under a mixed precision).
    """
    engine = model_dtype if engine_dtype in (None, "auto") else engine_dtype
    trainer = trainer_compute_dtype(model_dtype, trainer_precision)
    return (max_staleness or 0) > 0 or sync_every > 1 or engine != trainer


@dataclass(frozen=True)
class CorrectionWeights:
    """The weights of one micro-batch's policy-gradient terms and what they did (all detached)."""

    weight: Tensor  # [B, T] (token level) or [B, 1] (sequence level)
    ratio_mean: Tensor  # [] mean ratio over the level's units (trained tokens, or completions with trained tokens)
    ratio_max: Tensor  # [] largest ratio (0 without trained tokens)
    capped_frac: Tensor  # [] units whose ratio was above the cap (truncate)
    masked_frac: Tensor  # [] units outside [low, high] (mask): weight 0

    def metrics(self) -> dict[str, Tensor]:
        """The micro-batch means, by metric name (the max is logged apart, reduced by max)."""
        return {
            "train/is_ratio_mean": self.ratio_mean,
            "train/is_capped_frac": self.capped_frac,
            "train/is_masked_frac": self.masked_frac,
        }


@dataclass(frozen=True)
class RolloutCorrection:
    """`loss.rollout_correction`: TIS / MIS weights against the generator's log-probs (see the module docstring)."""

    enabled: bool | str = setting("auto", switch)
    level: str = setting("token", choice(*LEVELS))
    mode: str = setting("truncate", choice(*MODES))
    cap: float = setting(2.0, number(above=1))
    low: float = setting(0.5, number(low=0, below=1))
    high: float = setting(5.0, number(above=1))
    max_staleness: int | None = setting(0, optional(integer(0)))
    sync_every: int = setting(1, integer(1))
    engine_dtype: str = setting("auto", dtype_name)
    model_dtype: str = setting("float32", dtype_name)
    trainer_precision: str | int = setting("32-true", precision_name)

    def __post_init__(self) -> None:
        check_settings(self, "loss.rollout_correction")

    @property
    def active(self) -> bool:
        """`enabled`, with `auto` resolved by `correction_needed`."""
        if isinstance(self.enabled, bool):
            return self.enabled
        return correction_needed(
            self.max_staleness, self.sync_every, self.engine_dtype, self.model_dtype, self.trainer_precision
        )

    def weights(
        self,
        old_logp: Tensor,  # [B, T] the trainer's log-probs before the update
        gen_logp: Tensor,  # [B, T] the generator's log-probs of the same tokens
        mask: Tensor,  # [B, T] 1 = trained token
    ) -> CorrectionWeights:
        keep = mask != 0
        dtype = torch.promote_types(old_logp.dtype, torch.float32)
        diff = torch.where(keep, old_logp.detach().to(dtype) - gen_logp.detach().to(dtype), 0.0)  # [B, T]
        diff = torch.nan_to_num(diff, nan=0.0)
        if self.level == "sequence":
            units = keep.any(-1, keepdim=True)  # [B, 1]
            diff = diff.sum(-1, keepdim=True)  # [B, 1] the log of the product of the token ratios
        else:
            units = keep
        ratio = torch.exp(diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if self.mode == "truncate":
            weight = ratio.clamp(max=self.cap)
            capped, masked = ratio > self.cap, torch.zeros_like(units)
        else:
            masked = (ratio < self.low) | (ratio > self.high)
            weight = torch.where(masked, 0.0, ratio)
            capped = torch.zeros_like(units)
        count = units.sum().clamp(min=1)

        def frac(flags: Tensor) -> Tensor:
            return (flags & units).sum() / count

        return CorrectionWeights(
            weight=weight,
            ratio_mean=torch.where(units, ratio, 0.0).sum() / count,
            ratio_max=torch.where(units, ratio, 0.0).max(),
            capped_frac=frac(capped),
            masked_frac=frac(masked),
        )
