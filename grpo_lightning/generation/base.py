"""The generator interface every rollout engine implements.

A generator samples completions from token-id prefixes. A prefix is usually a chat-formatted prompt; a
variant that branches (STORPO) passes `prompt_ids + completion_ids[:k]` instead, so continuation is the same
call. Engines return token ids and the per-token log-probs of their own sampling distribution, which the
trainer compares against its own (`rollout/logp_diff_*`) to catch stale weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters shared by every engine (config group `generator`)."""

    num_generations: int = 4
    """Completions per prompt (G, the GRPO group size)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""

    def __post_init__(self) -> None:
        checks = [
            (self.num_generations >= 2, "num_generations", "must be >= 2", self.num_generations),
            (self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens),
            (
                math.isfinite(self.temperature) and self.temperature > 0,
                "temperature",
                "must be > 0",
                self.temperature,
            ),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)", self.top_k),
        ]
        for ok, key, rule, value in checks:
            if not ok:
                raise ValueError(f"generator.{key} {rule} (got {value!r})")


@dataclass
class Completion:
    """One sampled continuation of one prefix."""

    token_ids: list[int]
    """Sampled ids, up to and including EOS when the engine produced one."""
    logprobs: list[float]
    """Log-prob of each sampled id under the engine's (temperature-scaled) distribution."""
    finished: bool
    """False when max_new_tokens was reached without EOS (truncated)."""


@runtime_checkable
class Generator(Protocol):
    """What a rollout variant needs from an engine."""

    sampling: SamplingConfig

    def generate(
        self, prefixes: list[list[int]], num_samples: int, max_new_tokens: int | None = None
    ) -> list[list[Completion]]:
        """Sample `num_samples` completions for each token-id prefix; result[i][j] is sample j of prefix i.

        `max_new_tokens` defaults to `sampling.max_new_tokens`; a branching variant passes the budget left.
        """
        ...

    def sync_weights(self, policy: nn.Module) -> None:
        """Make the engine sample from the policy's current weights."""
        ...
