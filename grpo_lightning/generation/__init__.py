"""Rollout engines (HF `generate` on CPU, vLLM on GPU) behind one `Generator` protocol."""

from grpo_lightning.generation.base import Generator, SamplingConfig
from grpo_lightning.types import Completion

__all__ = ["Completion", "Generator", "SamplingConfig"]
