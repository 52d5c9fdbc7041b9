"""Rollout engines (HF `generate` on CPU, vLLM on GPU) behind one `Generator` base class."""

from grpo_lightning.generation.base import Generator, SamplingConfig
from grpo_lightning.types import Completion

__all__ = ["Completion", "Generator", "SamplingConfig"]
