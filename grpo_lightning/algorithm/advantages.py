"""Group-relative advantages for GRPO, for groups of arbitrary (unequal) sizes given by integer ids.

Sources, and why:

* DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), GRPO: the critic is replaced by the group baseline,
  `A_i = (r_i - mean_group(r)) / std_group(r)` (`scale_rewards="group"`).
* TRL `GRPOTrainer` `scale_rewards` semantics: the std is the unbiased sample std (`torch.std`, correction=1)
  plus `eps = 1e-4`; `"batch"` divides by the std of the whole batch instead of the group's, which is more
  robust when a group's rewards are nearly equal.
* Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): dividing by the group std up-weights questions that are too
  easy or too hard (a difficulty bias), so `"none"` keeps only the mean-centring, `A_i = r_i - mean_group(r)`.

Groups come as integer ids (not a fixed `[G, K]` reshape) because variants such as tree rollouts produce
groups of different sizes. A group of size 1 has an undefined std: it is treated as 0, and its advantage is 0.
A group whose rewards are all equal gets an advantage of exactly 0 (no float residue of the mean amplified by
1/eps).

Pure tensor code: imports only torch and the standard library (no Lightning, no Hydra).
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")


def _check(
    rewards: Tensor,  # [N]
    group_ids: Tensor,  # [N] long
) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N] (got {tuple(rewards.shape)} and {tuple(group_ids.shape)})"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor (got {group_ids.dtype})")


def _group_stats(
    values: Tensor,  # [N] float
    inverse: Tensor,  # [N] long, dense group index in [0, G)
    num_groups: int,
) -> tuple[Tensor, Tensor, Tensor]:  # mean [G], unbiased std [G] (0 for size 1), all-equal flag [G] bool
    zeros = values.new_zeros(num_groups)
    counts = zeros.index_add(0, inverse, torch.ones_like(values))
    mean = zeros.index_add(0, inverse, values) / counts
    squares = zeros.index_add(0, inverse, (values - mean[inverse]) ** 2)
    std = (squares / (counts - 1.0).clamp(min=1.0)).sqrt()
    high = zeros.scatter_reduce(0, inverse, values, reduce="amax", include_self=False)
    low = zeros.scatter_reduce(0, inverse, values, reduce="amin", include_self=False)
    return mean, std, high == low


def group_advantages(
    rewards: Tensor,  # [N] float
    group_ids: Tensor,  # [N] long, arbitrary ids (need not be sorted or contiguous)
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:  # [N], float32 (or the rewards' dtype when wider)
    """Group-relative advantages; `scale_rewards` in {"group", "batch", "none"} (see the module docstring)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"variant.scale_rewards must be one of {', '.join(SCALE_REWARDS)} (got {scale_rewards!r})")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0 (got {eps!r})")
    _check(rewards, group_ids)
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if values.numel() == 0:
        return values.clone()
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    mean, std, all_equal = _group_stats(values, inverse, unique_ids.numel())
    centred = values - mean[inverse]
    if scale_rewards == "group":
        centred = centred / (std[inverse] + eps)
    elif scale_rewards == "batch":
        batch_std = values.std() if values.numel() > 1 else values.new_zeros(())
        centred = centred / (batch_std + eps)
    return torch.where(all_equal[inverse], 0.0, centred)


def zero_std_group_fraction(
    rewards: Tensor,  # [N] float
    group_ids: Tensor,  # [N] long
) -> float:
    """Fraction of groups whose rewards are all equal (size-1 groups included); their advantages are 0.

    Logged as `train/frac_zero_std_groups`: such groups carry no learning signal. 0.0 for an empty batch.
    """
    _check(rewards, group_ids)
    if rewards.numel() == 0:
        return 0.0
    values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    _, _, all_equal = _group_stats(values, inverse, unique_ids.numel())
    return float(all_equal.float().mean().item())
