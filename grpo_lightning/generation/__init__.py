"""Rollout engines (HF `generate` on CPU, vLLM on GPU) behind one `Generator` protocol."""

from grpo_lightning.generation.base import Completion, Generator, SamplingConfig

__all__ = ["Completion", "Generator", "SamplingConfig"]
