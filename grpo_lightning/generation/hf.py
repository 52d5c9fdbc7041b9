"""The Hugging Face engine (generator=hf): samples from the policy object itself, LoRA adapters active.

There are no weights to sync: `sync_weights` only checks that the engine is still bound to the policy being trained.
How it samples (`HFEngine`, its settings, its speed levers) is hf_engine.py's, which the engine's copy beside the
trainer shares (`background_copy`, hf_snapshot.py). What only this engine does: swap other adapter weights in for a
while (`SwapsAdapters`: self-play's opponents, generation/adapters.py) and make that copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from grpo_lightning.generation.adapters import SwapsAdapters
from grpo_lightning.generation.hf_engine import HFEngine
from grpo_lightning.generation.hf_snapshot import SnapshotHFGenerator
from grpo_lightning.sharding import full_tensor


class HFGenerator(HFEngine, SwapsAdapters):
    """Batched sampling with left padding through `model.generate` or our decode loop, from the policy itself."""

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Sampling from the policy itself, on the trainer's device: int8 weights are a CPU kernel, and sampling
        beside the trainer (rollout.max_staleness >= 1) needs the decode loop's own random streams."""
        accelerator = cfg.trainer.get("accelerator")
        if cfg.perf.generate.get("weights") == "int8" and accelerator in ("gpu", "cuda", "mps"):
            raise ValueError(
                f"perf.generate.weights=int8 runs on the CPU only (torch's _weight_int8pack_mm CPU kernel) and "
                f"trainer.accelerator={accelerator} puts the policy the HF engine samples from there: use "
                "perf.generate.weights=bfloat16 or float32"
            )
        bound = OmegaConf.select(cfg, "rollout.max_staleness", default=0)
        if bound and not cfg.perf.generate.custom_decode:
            raise ValueError(
                f"rollout.max_staleness={bound} needs perf.generate.custom_decode=true: HF generate draws from the "
                "global RNG, which the trainer's thread owns, and so cannot sample beside it"
            )

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the policy's trainable parameters (its LoRA adapter), by name; full tensors under
        trainer=fsdp (gathered: every process calls this together)."""
        return {name: full_tensor(p.detach()).to("cpu", copy=True) for name, p in self._trainable().items()}

    @contextlib.contextmanager
    def sampling_from(self, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """Copy `weights` into the policy's trainable parameters in place while the block runs; the policy's own
        values are copied back afterwards (exactly: a copy, not a sum). Nothing trains during sampling, so no
        optimizer sees the borrowed values."""
        params = self._trainable()
        missing, unknown = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
        if missing or unknown:
            name = (missing or unknown)[0]
            raise ValueError(f"the snapshot does not match the policy's trainable parameters (first: {name})")
        saved = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to copy: this engine samples from the policy module itself."""
        if policy is not self.model:
            raise RuntimeError("HFGenerator was built for another model than the one being trained")

    def background_copy(self) -> SnapshotHFGenerator:
        """An engine on a snapshot of the policy (generation/hf_snapshot.py), for sampling beside the trainer."""
        return SnapshotHFGenerator(self)
