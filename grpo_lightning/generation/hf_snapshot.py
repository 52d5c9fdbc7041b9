"""The Hugging Face engine's copy that samples beside the trainer (`rollout.max_staleness` >= 1; docs/overlap.md).

While round k trains, round k+1 is sampled from the weights as they were when round k started training (one step
off-policy, as verl's `one_step_off_policy` recipe and open-instruct's `async_steps`). The trainer updates the
policy in place meanwhile, so the sampler cannot read the policy module: it samples from a copy of it.

- The copy shares the policy's FROZEN parameters (the same tensors: a LoRA policy's base is not doubled; nothing
  writes them, and `merged_lora` swaps new tensors in rather than merging in place) and owns copies of the
  TRAINABLE ones, which `sync_weights` refreshes from the policy at the start of each round's training.
- It never draws from the global RNG: the trainer's thread owns that. Each round's draws come from a
  `torch.Generator` seeded from the round's seed and the rank (with `seed_per_prefix`, one seeded from the round's
  seed and the prefix, as the plain engine does), so a resumed run samples the round in flight again, identically.
  A generator seeded with s draws what the global RNG draws after `torch.manual_seed(s)`, so a copy and the plain
  engine agree on identical seeds and weights (tests/unit/test_overlap_engine.py).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from dataclasses import asdict

import torch
from torch import nn

from grpo_lightning.distributed import derive_seed, rank_and_world
from grpo_lightning.generation.base import BackgroundEngine, SamplingCancelled, check_saved_weights
from grpo_lightning.generation.hf_engine import HFEngine
from grpo_lightning.types import Completion


def snapshot_module(policy: nn.Module) -> nn.Module:
    """A copy of `policy` for inference: its trainable parameters are new tensors (no gradient, no hooks), its
    frozen parameters are the policy's own objects (shared storage), its buffers are copied."""
    memo: dict[int, object] = {}
    for p in policy.parameters():
        memo[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=False) if p.requires_grad else p
    return copy.deepcopy(policy, memo)


@torch.no_grad()
def copy_trainable(policy: nn.Module, snapshot: nn.Module) -> int:
    """Copy the policy's trainable parameters into the snapshot (matched by name); returns how many."""
    target = dict(snapshot.named_parameters(remove_duplicate=False))
    count = 0
    for name, p in policy.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            target[name].copy_(p.detach())
            count += 1
    return count


def trainable_names(policy: nn.Module) -> list[str]:
    return [name for name, p in policy.named_parameters(remove_duplicate=False) if p.requires_grad]


class SnapshotHFGenerator(HFEngine, BackgroundEngine):
    """The HF engine (`HFEngine`) on a snapshot of the policy, with random streams of its own."""

    def __init__(self, engine: HFEngine) -> None:
        keys = asdict(engine.sampling) | asdict(engine.settings) | {"batch_size": engine.batch_size}
        keys["logp_diff_threshold"] = None  # the rollout loop judges rounds with the engine it was given
        super().__init__(
            snapshot_module(engine.model), engine.tokenizer, generation_settings=engine.generation_settings, **keys
        )
        if not self.generation_settings.custom_decode:
            raise ValueError(
                "perf.generate.custom_decode=false samples with HF generate, which draws from the global RNG and "
                "cannot run beside the trainer; keep perf.generate.custom_decode=true with rollout.max_staleness >= 1"
            )
        self.names = trainable_names(engine.model)
        """The policy's trainable parameters: what `sync_weights` copies and a checkpoint keeps (`weights`)."""
        self.cancel = threading.Event()

    def sync_weights(self, policy: nn.Module) -> None:
        """The policy's trainable weights, now, into the snapshot (its frozen ones are shared)."""
        copy_trainable(policy, self.model)

    def weights(self) -> dict[str, torch.Tensor]:
        """The snapshot's trainable weights (CPU copies), to save with a checkpoint."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return {name: params[name].detach().cpu().clone() for name in self.names}

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Weights from `weights()` back into the snapshot (a resumed run)."""
        check_saved_weights(self.names, weights)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name in self.names:
            params[name].copy_(weights[name])

    def reseed(self, round_seed: int) -> None:
        """The round's streams: one per rank, or one per prefix from (round seed, prefix) with seed_per_prefix."""
        self.round_seed = round_seed
        self.draws = self._generator(derive_seed(round_seed, "rank", rank_and_world()[0]))

    def _sampling_rng(self, prefix: list[int]):
        if not self.settings.seed_per_prefix:
            return contextlib.nullcontext()  # the round's stream, seeded by `reseed`
        return self._prefix_stream(derive_seed(self.round_seed, *prefix))

    @contextlib.contextmanager
    def _prefix_stream(self, seed: int) -> Iterator[None]:
        previous, self.draws = self.draws, self._generator(seed)
        try:
            yield
        finally:
            self.draws = previous

    def _generator(self, seed: int) -> torch.Generator:
        device = next(self.model.parameters()).device
        return torch.Generator(device=device).manual_seed(seed)

    def _generate_chunk(
        self, prefixes: list[list[int]], num_samples: int, max_new_tokens: int, greedy: bool = False
    ) -> list[list[Completion]]:
        if self.cancel.is_set():
            raise SamplingCancelled
        return super()._generate_chunk(prefixes, num_samples, max_new_tokens, greedy)
