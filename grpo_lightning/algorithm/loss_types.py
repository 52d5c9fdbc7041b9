"""Loss types (`loss.loss_type`) as registered objects: what differs between TRL's objectives lives here, and
nothing outside this module names a type (docs/extending.md, "Adding a loss type").

A loss type owns:

* `policy_term`: the per-token policy-gradient term from the ratio, the advantage and the log-probs (the PPO clipped
  surrogate, or CISPO's clipped IS weight times the log-prob);
* `clip_masks`: where its clip was active, below and above (TRL's `clip_ratio/low_mean`, `high_mean`);
* `aggregate`: how the per-token loss becomes one number (each sequence's token mean, the micro-batch's token mean,
  a constant length, or the whole optimizer step's trained tokens);
* `step_weighting` and `step_loss`: how micro-batches combine under Lightning's accumulation and DDP's gradient mean;
* `sample_weights`: each completion's weight in the loss, in the type's sample unit (the GNS probe's B, the ESS);
* `advantage_scale`: what `reward.transforms.normalize.scale: auto` means for it;
* `check`: settings the type cannot run with, named by key; `options` (its own node, `loss.<name>`) and `requires`
  (values of other keys it runs with only, which its preset `loss=<name>` sets), checked against the loss node
  in `loss_options.py`.

`losses.GRPOLoss` keeps what every type shares: the ratio (token or sequence level), the rollout correction and the
k3 KL. Sources for each type are in its class docstring.

Pure tensor code: imports only torch and the standard library.
"""

from __future__ import annotations

import functools
import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from grpo_lightning.schema import check_settings, number, setting

_REGISTRY: dict[str, LossType] = {}


def register_loss_type(name: str) -> Callable[[type[LossType]], type[LossType]]:
    """Class decorator: make the loss type selectable as `loss.loss_type=<name>`."""

    def add(cls: type[LossType]) -> type[LossType]:
        if name in _REGISTRY:
            raise ValueError(f"loss type {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls()
        return cls

    return add


def loss_type(name: str) -> LossType:
    """The loss type `name`: a registered name, or the import path of a `LossType` subclass of one's own
    (`loss.loss_type=my_pkg.losses.MyType`, docs/extending.md); one line naming the key otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    problem = loss_type_problem(name)
    if problem is not None:
        raise ValueError(f"loss.loss_type {problem} (got {name!r})")
    return _imported(name)


@functools.cache
def _imported(path: str) -> LossType:
    """One instance of a loss type of one's own per import path (loss types hold no state)."""
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)()


def loss_type_problem(value: Any) -> str | None:
    """The config rule of `loss.loss_type`: a registered name, or an importable `LossType` subclass."""
    expected = f"must be one of {', '.join(_REGISTRY)}, or the import path of a LossType subclass"
    if not isinstance(value, str):
        return expected
    if value in _REGISTRY:
        return None
    if "." not in value:
        return expected
    module, _, attribute = value.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return expected
    return None if isinstance(cls, type) and issubclass(cls, LossType) else expected


@dataclass(frozen=True)
class PolicyInputs:
    """What a loss type's per-token term is computed from (untrained positions hold 0 in every tensor)."""

    ratio: Tensor  # [B, T] pi / pi_old per token, or [B, 1] one per completion (GSPO's sequence level)
    adv: Tensor  # [B, 1] one advantage per completion, or [B, T] one per token
    logp: Tensor  # [B, T] policy log-probs (differentiable)
    log_ratio: Tensor  # [B, T] logp - old_logp per token, whatever the ratio's level
    weights: Tensor  # [B, T] 1.0 on trained tokens


class LossType(ABC):
    """One objective's aggregation, clip rule and sample unit (the module docstring lists what each owns)."""

    name: ClassVar[str] = ""
    step_normalised: ClassVar[bool] = False
    """Divided by the trained tokens of the whole optimizer step (all micro-batches, all ranks; TRL's
    `num_items_in_batch`, TRL issue #3021) rather than by something of the micro-batch."""
    advantage_scale: ClassVar[str] = "group"
    """What the advantage normalisation's `scale: auto` means: `group` (divide by the group's std) or `none`."""
    options: ClassVar[str | None] = None
    """The loss node's sub-node this type reads its own settings from (`sapo`: `loss.sapo.*`, a `LossTypeOptions`
    field); a loss of another type refuses that node."""
    requires: ClassVar[Mapping[str, tuple[Any, str]]] = {}
    """Keys below `loss.` this type runs with at one value only, as `{key: (value, why)}`; its preset sets them,
    and a composed config holding another value (another preset with `loss.loss_type` changed) is refused, never
    changed (`loss_options.config_problems`)."""

    def check(self, loss: Any) -> None:  # noqa: B027 - no constraint by default
        """Raise a one-line ValueError naming the key for settings of `loss` (the `loss` node's `GRPOLoss`) this
        type cannot run with (another type's options: `loss_options.check_options`)."""

    def requirement_problem(self, key: str, value: Any) -> str:
        """The line refusing `loss.<key>=<value>`, which this type does not run with (`requires`)."""
        needed, why = self.requires[key]
        preset = f"choose its preset, loss={self.name}, which sets it, or " if _REGISTRY.get(self.name) is self else ""
        shown, need = ("null" if v is None else str(v).lower() if isinstance(v, bool) else v for v in (value, needed))
        return (
            f"loss.{key}={shown} with loss_type {self.name}: {why}, so loss.loss_type={self.name} runs only with "
            f"loss.{key}={need}; {preset}set loss.{key}={need}"
        )

    # ---- the per-token term --------------------------------------------------------------------------------------
    def policy_term(self, x: PolicyInputs, loss: Any) -> Tensor:  # broadcastable to [B, T]
        """The PPO clipped surrogate, `-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` (DeepSeekMath's GRPO)."""
        clipped = torch.clamp(x.ratio, 1.0 - loss.epsilon_low, 1.0 + loss.epsilon_high)
        return -torch.minimum(x.ratio * x.adv, clipped * x.adv)

    def clip_masks(
        self, ratio: Tensor, adv: Tensor, epsilon_low: float, epsilon_high: float
    ) -> tuple[Tensor, Tensor]:  # bool, broadcast shape of ratio and adv
        """Where the clip was active: below (r < 1 - eps_low, A < 0) and above (r > 1 + eps_high, A > 0)."""
        return (ratio < 1.0 - epsilon_low) & (adv < 0), (ratio > 1.0 + epsilon_high) & (adv > 0)

    # ---- aggregation -----------------------------------------------------------------------------------------------
    @abstractmethod
    def aggregate(
        self,
        token_sum: Tensor,  # [B, T] the per-token loss, 0 on untrained tokens
        weights: Tensor,  # [B, T] 1.0 on trained tokens
        max_completion_length: int,
        num_tokens_in_step: float | None,
    ) -> Tensor:  # []
        """The micro-batch's scalar loss."""

    @property
    def step_weighting(self) -> Literal["micro_batch", "sample"]:
        """How the optimizer step's gradient weighs micro-batches: `micro_batch` (Lightning's mean over them) or
        `sample` (step-normalised types: the step is the mean over all its completions' tokens)."""
        return "sample" if self.step_normalised else "micro_batch"

    def step_loss(self, loss: Tensor, accumulate_grad_batches: int, world_size: int) -> Tensor:  # []
        """The micro-batch loss to backpropagate: Lightning divides each by `accumulate_grad_batches` and DDP
        averages gradients over ranks, right for a mean of micro-batch losses; a step-normalised loss is already
        divided by the whole step's tokens, so both are undone."""
        return loss * accumulate_grad_batches * world_size if self.step_normalised else loss

    def sample_weights(self, mask: Tensor) -> Tensor:  # mask [B, C] -> [B]
        """Each completion's weight in the loss, in the type's sample unit: equal by default (one value per
        completion averaged; a row without trained tokens still counts, since the loss divides by it)."""
        return torch.ones(mask.shape[0], device=mask.device)


def _step_tokens(num_tokens_in_step: float | None, name: str) -> float:
    if num_tokens_in_step is None:
        raise ValueError(f"loss_type {name!r} needs num_tokens_in_step (trained tokens in the step)")
    num_tokens = float(num_tokens_in_step)
    if not num_tokens >= 0:
        raise ValueError(f"num_tokens_in_step must be >= 0 (got {num_tokens_in_step!r})")
    return max(num_tokens, 1.0)  # a step without trained tokens gives a zero loss, not NaN


@register_loss_type("grpo")
class SequenceMean(LossType):
    """Each sequence averaged over its own length, then over sequences (TRL's `grpo`; DeepSeekMath): longer answers
    get less weight per token."""

    def aggregate(self, token_sum, weights, max_completion_length, num_tokens_in_step):
        return (token_sum.sum(-1) / weights.sum(-1).clamp(min=1.0)).mean()


@register_loss_type("bnpo")
class MicroBatchTokenMean(LossType):
    """The mean over every trained token of the micro-batch (TRL's `bnpo`); a completion weighs by its tokens."""

    def aggregate(self, token_sum, weights, max_completion_length, num_tokens_in_step):
        return token_sum.sum() / weights.sum().clamp(min=1.0)

    def sample_weights(self, mask: Tensor) -> Tensor:
        return mask.sum(-1).float()


@register_loss_type("dr_grpo")
class ConstantLength(LossType):
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): the token sum divided by the CONSTANT `B * max_completion_length`
    (dividing by each sequence's length biases training toward long wrong answers), and no std division in the
    advantage."""

    advantage_scale = "none"

    def aggregate(self, token_sum, weights, max_completion_length, num_tokens_in_step):
        return token_sum.sum() / (token_sum.shape[0] * max_completion_length)


@register_loss_type("dapo")
class StepTokenMean(LossType):
    """DAPO (Yu et al. 2025, arXiv 2503.14476): token-level normalisation over the whole optimizer step (TRL issue
    #3021: the micro-batch losses sum to the full-batch loss), with the decoupled clip range (`epsilon_high >
    epsilon_low`, "clip-higher")."""

    step_normalised = True

    def aggregate(self, token_sum, weights, max_completion_length, num_tokens_in_step):
        return token_sum.sum() / _step_tokens(num_tokens_in_step, self.name)


@register_loss_type("cispo")
class ClippedISWeight(StepTokenMean):
    """CISPO (MiniMax 2025, arXiv 2506.13585): `-sg(min(r, epsilon_high)) * A * logp`. The IS weight is clipped, not
    the update, so every token keeps a gradient; as in TRL, `epsilon_high` is the cap of the weight itself (ScaleRL,
    arXiv 2510.13786: 5.0), and the token sum is divided like `dapo`'s."""

    def check(self, loss: Any) -> None:
        if loss.epsilon_high < 1:
            raise ValueError(
                f"loss.epsilon_high must be >= 1 for loss_type cispo, where it caps the IS weight itself (TRL's "
                f"convention; ScaleRL: 5.0) (got {loss.epsilon_high!r})"
            )

    def policy_term(self, x: PolicyInputs, loss: Any) -> Tensor:
        return -torch.clamp(x.ratio, max=loss.epsilon_high).detach() * x.adv * x.logp

    def clip_masks(self, ratio, adv, epsilon_low, epsilon_high):
        return torch.zeros_like(ratio, dtype=torch.bool), (ratio > epsilon_high) & (adv > 0)


def _no_clip(ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    none = torch.zeros(torch.broadcast_shapes(ratio.shape, adv.shape), dtype=torch.bool, device=ratio.device)
    return none, none


@dataclass(frozen=True)
class SapoSettings:
    """`loss.sapo`: the temperatures of SAPO's soft gate (TRL 1.16's `sapo_temperature_pos` / `_neg`)."""

    temperature_pos: float = setting(1.0, number(above=0))
    temperature_neg: float = setting(1.05, number(above=0))

    def __post_init__(self) -> None:
        check_settings(self, "loss.sapo")


@register_loss_type("sapo")
class SoftGate(SequenceMean):
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv 2511.20347; TRL 1.16's `sapo`): the hard clip
    replaced by a smooth gate, `-(4 / tau) * sigmoid(tau * (r - 1)) * A`, with tau = `loss.sapo.temperature_pos`
    where A > 0 and `temperature_neg` elsewhere; its gradient `sigmoid'(.) * 4 * A * r * grad(logp)` equals the
    unclipped one at r = 1 and fades smoothly away from it. Aggregated as `grpo` (each sequence's token mean). No
    clip, so no clip ratio."""

    options = "sapo"

    def policy_term(self, x: PolicyInputs, loss: Any) -> Tensor:
        tau = torch.where(x.adv > 0, loss.sapo.temperature_pos, loss.sapo.temperature_neg)
        return -torch.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau * x.adv

    def clip_masks(self, ratio, adv, epsilon_low, epsilon_high):
        return _no_clip(ratio, adv)


@register_loss_type("luspo")
class SequenceSum(LossType):
    """LUSPO (TRL 1.16's `luspo`, length-unbiased sequence policy optimization): the clipped surrogate, each sequence's
    token SUM averaged over sequences, so a sequence-level ratio (`importance_sampling_level: sequence`, the paper's
    setting, as `loss=luspo` sets) weighs each completion by its length."""

    def aggregate(self, token_sum, weights, max_completion_length, num_tokens_in_step):
        return token_sum.sum(-1).mean()


@dataclass(frozen=True)
class VespoSettings:
    """`loss.vespo`: the shape of VESPO's sequence weight for A >= 0 (`k_pos`, `lambda_pos`) and A < 0 (TRL 1.16's
    `vespo_k_pos`, ...)."""

    k_pos: float = setting(2.0, number(low=0))
    lambda_pos: float = setting(3.0, number(above=0))
    k_neg: float = setting(3.0, number(low=0))
    lambda_neg: float = setting(2.0, number(above=0))

    def __post_init__(self) -> None:
        check_settings(self, "loss.vespo")


@register_loss_type("vespo")
class GammaSequenceWeight(StepTokenMean):
    """VESPO (TRL 1.16's `vespo`): `-sg(phi(w)) * A * logp`, with the sequence's importance weight
    `w = exp(clamp(sum_t clamp(log r_t, -20, 20), log 1e-8, 20))` (a SUM of the token log-ratios, whatever
    `importance_sampling_level` says) and the gamma-shaped weight `phi(w) = exp(lambda + k log w - lambda w)`
    (k, lambda from `loss.vespo`, the `pos` pair where A >= 0), which peaks at w = k / lambda and vanishes for
    sequences far off-policy; a non-finite phi is 0. Aggregated as `dapo` (the step's trained tokens). TRL folds its
    vLLM importance ratio into w; here the rollout correction stays a separate factor (`loss.rollout_correction`),
    so VESPO runs with it off."""

    options = "vespo"
    requires = {"rollout_correction.enabled": (False, "VESPO weighs whole sequences by their own importance weight")}

    def check(self, loss: Any) -> None:
        if loss.rollout_correction.active:  # `auto` too where it resolves on (the config check refuses any `auto`)
            raise ValueError(self.requirement_problem("rollout_correction.enabled", loss.rollout_correction.enabled))

    def policy_term(self, x: PolicyInputs, loss: Any) -> Tensor:
        with torch.no_grad():
            floor = math.log(1e-8)
            seq = (torch.clamp(x.log_ratio, -20.0, 20.0) * x.weights).sum(-1, keepdim=True)  # [B, 1]
            log_w = torch.clamp(seq, floor, 20.0)
            positive = x.adv >= 0
            v = loss.vespo
            k = torch.where(positive, v.k_pos, v.k_neg)
            lam = torch.where(positive, v.lambda_pos, v.lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return -phi * x.adv * x.logp

    def clip_masks(self, ratio, adv, epsilon_low, epsilon_high):
        return _no_clip(ratio, adv)


@dataclass(frozen=True)
class LossTypeOptions:
    """The loss node's sub-nodes that belong to one loss type each (`loss.sapo.*`, `loss.vespo.*`), declared
    beside their types; the loss (`GRPOLoss`) takes them as its own fields. A type that reads its options gets the
    loss's settings in `check` and `policy_loss`."""

    sapo: SapoSettings = setting(factory=SapoSettings)
    vespo: VespoSettings = setting(factory=VespoSettings)
