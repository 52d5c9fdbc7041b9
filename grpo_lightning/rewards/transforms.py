"""Built-in reward transforms, composed in order by the reward pipeline (`grpo_lightning.rewards.pipeline`).

Three places, after the peer design of Unstable Baselines (final, step and sampling transforms):

* per-completion transforms, after the weighted sum of the terms: `__call__(reward, **info) -> float`
  (`Clip`, `Scale`, `Ternary`);
* per-step shaping, for variants that know reasoning steps (STORPO): `__call__(reward, steps, **info) -> float`
  with `steps` the completion's reasoning steps and `info["branch_step"]` the step a continuation starts in
  (`StepFormat`, `StepDiscount`);
* group transforms, over a round's rewards before the advantage:
  `__call__(rewards [N], group_ids [N]) -> [N]`; the last one's output is the advantage (`GroupNormalize`, which
  is today's advantage, and `EMABaseline`). A stateful one overrides `state_dict()` / `load_state_dict()`, which
  the rollout loop saves in every checkpoint.

Each derives from `grpo_lightning.rewards.base.Transform`, whose defaults (no context, no state) the pipeline
relies on.

Each is a small class whose constructor arguments are its config keys; a constructor's ValueError names the key
without its config prefix (the pipeline builder adds `reward.<place>.<name>: `).
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from grpo_lightning.algorithm.advantages import SCALE_REWARDS, group_advantages
from grpo_lightning.algorithm.loss_types import loss_type as loss_type_of
from grpo_lightning.rewards.base import Transform
from grpo_lightning.types import TurnRecord


def _finite(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number (got {value!r})")


# ---- per completion --------------------------------------------------------------------------------------------
class Clip(Transform):
    """Clamp the reward to [low, high]; either bound may be null (no bound)."""

    def __init__(self, low: float | None = None, high: float | None = None) -> None:
        _finite("low", low, allow_none=True)
        _finite("high", high, allow_none=True)
        if low is not None and high is not None and low > high:
            raise ValueError(f"low ({low}) must be <= high ({high})")
        self.low, self.high = low, high

    def __call__(self, reward: float, **info) -> float:
        if self.low is not None and reward < self.low:
            return float(self.low)
        if self.high is not None and reward > self.high:
            return float(self.high)
        return reward


class Scale(Transform):
    """`factor * reward + shift`."""

    def __init__(self, factor: float = 1.0, shift: float = 0.0) -> None:
        _finite("factor", factor)
        _finite("shift", shift)
        self.factor, self.shift = factor, shift

    def __call__(self, reward: float, **info) -> float:
        return self.factor * reward + self.shift


class Ternary(Transform):
    """Map the reward to {-1, 0, 1} (win / draw / loss): 1 at or above `high`, -1 at or below `low`, else 0.

    The defaults fit the GSM8K reward: a correct answer (1.0) is 1, a wrong answer in a recognised format
    (the format bonus) is 0, no answer (0.0) is -1.
    """

    def __init__(self, high: float = 1.0, low: float = 0.0) -> None:
        _finite("high", high)
        _finite("low", low)
        if not low < high:
            raise ValueError(f"low ({low}) must be < high ({high})")
        self.high, self.low = high, low

    def __call__(self, reward: float, **info) -> float:
        if reward >= self.high:
            return 1.0
        if reward <= self.low:
            return -1.0
        return 0.0


# ---- per reasoning step ----------------------------------------------------------------------------------------
class StepFormat(Transform):
    """A step-format reward: `bonus` for each of the completion's own reasoning steps that matches `pattern`
    (by default, one that shows a computed result, `= <number>`), at most `max_bonus` in all.

    A STORPO continuation's own steps are those from its branch step on (`own_steps_only`); the shared prefix
    was the initial completion's work and is rewarded there.
    """

    def __init__(
        self, bonus: float = 0.02, max_bonus: float = 0.1, pattern: str = r"=\s*\$?-?\d", own_steps_only: bool = True
    ) -> None:
        _finite("bonus", bonus)
        _finite("max_bonus", max_bonus)
        if max_bonus < 0 or bonus < 0:
            raise ValueError(f"bonus and max_bonus must be >= 0 (got {bonus!r}, {max_bonus!r})")
        try:
            self.pattern = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"pattern {pattern!r} is not a regular expression ({err})") from None
        self.bonus, self.max_bonus, self.own_steps_only = bonus, max_bonus, own_steps_only

    def __call__(self, reward: float, steps: list[str], branch_step: int = 0, **info) -> float:
        own = steps[branch_step:] if self.own_steps_only else steps
        matched = sum(1 for step in own if self.pattern.search(step))
        return reward + min(self.bonus * matched, self.max_bonus)


class StepDiscount(Transform):
    """`reward * gamma ** (steps - 1)`: a discount per reasoning step that favours shorter solutions."""

    def __init__(self, gamma: float = 0.98) -> None:
        _finite("gamma", gamma)
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1] (got {gamma!r})")
        self.gamma = gamma

    def __call__(self, reward: float, steps: list[str], **info) -> float:
        return reward * self.gamma ** max(len(steps) - 1, 0)


# ---- over the round's rewards (before the advantage) ----------------------------------------------------------
class GroupNormalize(Transform):
    """Group-relative advantage (`grpo_lightning.algorithm.advantages.group_advantages`): centre on the group mean, then
    divide by the group std (`group`), the batch std (`batch`) or nothing (`none`, Dr. GRPO).

    `auto` takes the scaling the loss type is defined with (`LossType.advantage_scale`).
    """

    baseline = "group"

    def __init__(self, scale: str = "auto", eps: float = 1e-4) -> None:
        if scale != "auto" and scale not in SCALE_REWARDS:
            raise ValueError(f"scale must be one of {', '.join(SCALE_REWARDS)}, auto (got {scale!r})")
        _finite("eps", eps)
        if eps < 0:
            raise ValueError(f"eps must be >= 0 (got {eps!r})")
        self.scale, self.eps = scale, eps

    def bind(self, loss_type: str | None = None, max_new_tokens: int | None = None) -> None:
        """Resolve `auto` once the loss is known (the pipeline builder calls this)."""
        if self.scale == "auto":
            self.scale = loss_type_of(loss_type).advantage_scale if loss_type else "group"  # e.g. Dr. GRPO: none

    def describe_settings(self) -> str:
        return f"scale={self.scale}"

    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        scale = "group" if self.scale == "auto" else self.scale
        return group_advantages(rewards, group_ids, scale, self.eps)


class EMABaseline(Transform):
    """REINFORCE with a running baseline: `A = r - b`, with b an exponential moving average of the rounds' mean
    rewards (`b <- decay * b + (1 - decay) * mean`, b = the first round's mean to start), taken BEFORE this
    round updates it. `scale: batch` also divides by the round's reward std (+ eps).

    Use it instead of `normalize` (a group normalisation after it would centre its output again). Its state is
    saved in every checkpoint, so a resumed run continues with the same baseline; under several processes each
    process keeps its own baseline over its own rollouts.
    """

    baseline = "own"

    def __init__(self, decay: float = 0.9, scale: str = "none", eps: float = 1e-4) -> None:
        _finite("decay", decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1) (got {decay!r})")
        if scale not in ("batch", "none"):
            raise ValueError(f"scale must be one of batch, none (got {scale!r})")
        self.decay, self.scale, self.eps = decay, scale, eps
        self.value: float | None = None
        self.rounds = 0

    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        if values.numel() == 0:
            return values.clone()
        mean = float(values.double().mean())
        baseline = mean if self.value is None else self.value
        advantages = values - baseline
        if self.scale == "batch":
            std = values.std() if values.numel() > 1 else values.new_zeros(())
            advantages = advantages / (std + self.eps)
        self.value = self.decay * baseline + (1.0 - self.decay) * mean
        self.rounds += 1
        return advantages

    def state_dict(self) -> dict:
        return {"value": self.value, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.rounds = state["value"], state["rounds"]

    def describe_settings(self) -> str:
        return f"scale={self.scale}"


class RoleBaseline(Transform):
    """Self-play's role baseline (SPIRAL's role-conditioned advantage estimation; reward=selfplay_role): a turn's
    reward minus a running mean of the rewards of its role, the (game, seat) pair, taken BEFORE the turn updates
    it (`b <- decay * b + (1 - decay) * r`, b = 0 to start). It removes the first mover's advantage, which a
    group of games in one seat does not see. A per-completion transform: it reads the turn's record
    (`info["record"]`, types.TurnRecord), so it serves variant=selfplay only. Its state is saved in every
    checkpoint."""

    def __init__(self, decay: float = 0.95) -> None:
        _finite("decay", decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1) (got {decay!r})")
        self.decay = decay
        self.baselines: dict[str, float] = {}

    def __call__(self, reward: float, **info) -> float:
        record = info.get("record")
        if not isinstance(record, TurnRecord):
            raise TypeError(f"RoleBaseline needs a self-play turn's record (variant=selfplay); got {record!r}")
        role = f"{record.game_id}/seat{record.seat}"
        baseline = self.baselines.get(role, 0.0)
        self.baselines[role] = self.decay * baseline + (1.0 - self.decay) * reward
        return reward - baseline

    def state_dict(self) -> dict:
        return {"baselines": dict(self.baselines)}

    def load_state_dict(self, state: dict) -> None:
        self.baselines = dict(state["baselines"])

    def describe_settings(self) -> str:
        return f"decay={self.decay:g}"


class BatchNormalize(Transform):
    """The round's rewards centred on the round's mean and divided by its std + eps (a batch z-score, eps inside
    the division: a round of equal rewards gives zeros, not a division by zero). Groups play no part: the
    baseline is the round's (with RoleBaseline before it, reward=selfplay_role)."""

    baseline = "own"

    def __init__(self, eps: float = 1e-4) -> None:
        _finite("eps", eps)
        if eps <= 0:
            raise ValueError(f"eps must be > 0 (got {eps!r})")
        self.eps = eps

    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        if values.numel() < 2:
            return torch.zeros_like(values)
        return (values - values.mean()) / (values.std() + self.eps)
