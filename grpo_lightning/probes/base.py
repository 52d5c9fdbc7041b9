"""What a probe is (`Probe`) and what it reads of the module it observes (`ProbedModule`).

A probe is a Lightning callback of the `probe` config group that observes training and never changes it. The
module it observes is the training module (`GRPOModule`, grpo_lightning/training/module.py), which a probe cannot
import: training and probes are sibling layers (pyproject.toml, [tool.importlinter]). `ProbedModule` names the
part of it the probes read, so they read it directly, and a test stands in for it with a small module of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import lightning as L
import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from grpo_lightning.accel import ForwardSettings
    from grpo_lightning.accel.entropy_terms import EntropyTerms
    from grpo_lightning.types import RolloutBatch


class Probe(L.Callback):
    """A diagnostic callback of the `probe` config group; train.py checks it against the run before training."""

    def check_setup(self, micro_batches_per_step: int, world_size: int) -> None:
        """Raise ValueError when the run's shape leaves the probe nothing to measure. No-op: most probes measure
        whatever the shape."""


class ProbedModule(Protocol):
    """What the probes read (and, for the entropy probe's hooks, set) on the LightningModule they observe, besides
    its `parameters()`."""

    device: torch.device
    policy: nn.Module
    temperature: float
    """The sampling temperature the training forward divides the logits by."""
    forward_settings: ForwardSettings
    step_weighting: Literal["micro_batch", "sample"]
    """How the optimizer step weighs micro-batches: `micro_batch` (Lightning's mean over micro-batches:
    mean-normalised loss types) or `sample` (each micro-batch by its share of the step's samples: step-normalised
    types; `LossType.step_weighting`)."""
    entropy_observer: Callable[[Tensor, EntropyTerms, RolloutBatch], None] | None
    """Set by the entropy probe: called by the training step with each micro-batch's entropies."""
    entropy_grad: bool
    """Set by the entropy probe: whether the training forward also returns the entropy's gradient terms."""

    def sample_weights(self, batch: RolloutBatch) -> Tensor:
        """Weight of each completion in the micro-batch's loss, [B]."""
        ...

    def log_dict(self, dictionary: dict, **kwargs) -> None:
        """LightningModule's own: how a probe logs its metrics."""
        ...
