"""Engines that sample from other adapter weights than the policy's for a while: self-play's opponents.

Self-play (variant=selfplay, docs/selfplay.md) plays the policy against its own earlier snapshots and against the
base model (its adapter off). It keeps those opponents as copies of the policy's trainable (LoRA) weights and samples
an opponent's moves through an engine that takes such a copy in place of the policy's own while the moves are
sampled. That is the `SwapsAdapters` interface: the HF engine has it (generation/hf.py), swapping the weights in
place; an engine without it cannot play self-play, and the self-play variant and its evaluator ask for it
(`swapping_adapters`).
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager

from torch import Tensor

from grpo_lightning.generation.base import Generator


class SwapsAdapters(Generator):
    """An engine that samples from adapter weights other than the policy's current ones while a block runs."""

    @abstractmethod
    def adapter_weights(self) -> dict[str, Tensor]:
        """CPU copies of the weights training changes (LoRA) that this engine samples from, by parameter name: a
        self-play snapshot."""

    @abstractmethod
    def sampling_from(self, weights: dict[str, Tensor]) -> AbstractContextManager[None]:
        """Sample from `weights` (an `adapter_weights()` result) while the block runs, then from the policy again,
        bit for bit."""


def swapping_adapters(engine: Generator, player: str) -> SwapsAdapters:
    """`engine` as one that swaps adapters, or one line naming generator=hf (`player`: what plays the snapshots,
    e.g. variant=selfplay)."""
    if not isinstance(engine, SwapsAdapters):
        raise ValueError(
            f"{player} plays opponents from snapshots of the policy, which {type(engine).__name__} cannot swap in "
            "yet; use generator=hf"
        )
    return engine
