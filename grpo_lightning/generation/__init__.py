"""Rollout engines (HF `generate` on CPU, vLLM on GPU) behind one `Generator` base class; `SwapsAdapters`: an engine
that can sample from other adapter weights for a while (self-play's opponents; the HF engine)."""

from grpo_lightning.generation.adapters import SwapsAdapters
from grpo_lightning.generation.base import Generator, SamplingConfig
from grpo_lightning.types import Completion

__all__ = ["Completion", "Generator", "SamplingConfig", "SwapsAdapters"]
