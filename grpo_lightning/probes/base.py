"""What a probe is (`Probe`, and `ForwardProbe` for one that reads the training forward) and what it reads of the
module it observes (`ProbedModule`).

A probe is a Lightning callback of the `probe` config group that observes training and never changes it. The
module it observes is the training module (`GRPOModule`, grpo_lightning/training/module.py), which a probe cannot
import: training and probes are sibling layers (pyproject.toml, [tool.importlinter]). `ProbedModule` names the
part of it the probes read, so they read it directly, and a test stands in for it with a small module of its own;
`ForwardProbe` implements the calls the module makes on a forward observer (module.py `ForwardObserver`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Literal, Protocol

import lightning as L
import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from grpo_lightning.accel import ForwardSettings
    from grpo_lightning.accel.entropy_terms import EntropyTerms
    from grpo_lightning.types import RolloutBatch

ForwardNeed = Literal["logprobs", "entropy", "entropy_gradient"]
"""What a probe needs of a micro-batch's training forward, each more than the one before: its completion
log-probs; also the token entropies of the same logits; also their gradient terms (`EntropyTerms`)."""


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

    def add_forward_observer(self, observer: ForwardProbe) -> None:
        """Have the training step call `observer` with every micro-batch's forward (`ForwardProbe`)."""
        ...

    def remove_forward_observer(self, observer: ForwardProbe) -> None:
        """Stop calling `observer`; one that was never added is no error."""
        ...

    def sample_weights(self, batch: RolloutBatch) -> Tensor:
        """Weight of each completion in the micro-batch's loss, [B]."""
        ...

    def log_dict(self, dictionary: dict, **kwargs) -> None:
        """LightningModule's own: how a probe logs its metrics."""
        ...


class ForwardProbe(Probe, ABC):
    """A probe that reads the training forward: the training step calls `observe_forward` with each micro-batch's
    forward that `forward_need` asks for, after computing it and before the loss.

    Why the module calls the probe, rather than the probe reading the module or setting its flags: the training
    forward is computed once, inside the step, and what a probe needs of it (entropies, their gradient) changes
    what the step computes; the module asks every observer the same question and makes the same call, naming
    none. The probe registers itself at the start of fit and leaves at teardown: a subclass that overrides
    `on_fit_start` or `teardown` calls this class's too.
    """

    def on_fit_start(self, trainer: L.Trainer, pl_module: ProbedModule) -> None:
        pl_module.add_forward_observer(self)

    def teardown(self, trainer: L.Trainer, pl_module: ProbedModule, stage: str) -> None:
        pl_module.remove_forward_observer(self)

    def forward_need(self, batch: RolloutBatch) -> ForwardNeed | None:
        """What it needs of this micro-batch's forward; None: it does not observe this one. Default: the log-probs of
        every micro-batch (they cost nothing extra: the loss needs them)."""
        return "logprobs"

    @abstractmethod
    def observe_forward(self, batch: RolloutBatch, logp: Tensor, terms: EntropyTerms | None) -> None:
        """One micro-batch's forward: the batch, its completion log-probs [B, C] at the sampling temperature, still
        in the loss's graph (detach what is kept: a probe never changes training), and its `EntropyTerms` (None
        unless a need of "entropy" or more, or the loss's entropy bonus, had them computed)."""
