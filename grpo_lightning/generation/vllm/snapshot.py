"""The engine overlapped rounds sample from under `generator=vllm` and `generator=vllm_server` (docs/overlap.md):
the generator's own engine process or servers, holding the weights pushed when a round starts training, and the
policy's trainable weights as they were pushed, for a checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from grpo_lightning.generation.base import BackgroundEngine, SamplingCancelled, SamplingConfig, check_saved_weights
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.types import Completion


class SnapshotSource(Protocol):
    """What the snapshot uses of its generator (`VLLMGenerator`, `VLLMServerGenerator`): its settings, its policy,
    sampling, the CPU threads it samples with, and pushing the policy's weights into the engine or servers."""

    sampling: SamplingConfig
    guard: StaleWeightGuard
    policy: nn.Module

    def use_engine_threads(self, threads: int) -> None: ...

    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]: ...

    def push_weights(self) -> None: ...

    def reseed(self, round_seed: int) -> None: ...


class VLLMSnapshot(BackgroundEngine):
    """The engine overlapped rounds sample from (`rollout.max_staleness` >= 1; docs/overlap.md): the generator's
    own engine process (`generator=vllm`) or servers (`generator=vllm_server`), holding the weights pushed when a
    round starts training.

    No second engine: evaluation runs between rounds, never while a round is sampled (the rollout loop pushes the
    current weights before it), so one engine process, or one set of servers, serves both. By default no push
    lands while a round is sampled either: the next push waits for the round (the rollout loop joins it first), so
    every completion is sampled from one version, start to end. With `in_flight_push` (servers with
    `generator.push_in_flight`) the rollout loop pushes after every optimizer step of the round being trained
    (`push_in_flight`), and a completion records the first and last version it may have been sampled with.
    `weights()` keeps the policy's trainable tensors as they were at the round's start, for a checkpoint;
    `load_weights` pushes such a snapshot back.
    """

    def __init__(self, generator: SnapshotSource, in_flight_push: Callable[[], None] | None = None) -> None:
        self.generator = generator
        self.in_flight_push = in_flight_push
        self.sampling = generator.sampling
        self.guard = generator.guard
        self.callbacks: list[L.Callback] = []
        self.cancel = threading.Event()
        self._weights: dict[str, torch.Tensor] = {}

    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        if self.cancel.is_set():
            raise SamplingCancelled("the run stopped while a round was being sampled")
        return self.generator.sample(prefixes, num_samples, budgets, greedy)

    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights now (every round: `generator.sync_every` applies to sequential rounds)."""
        self._weights = trainable_weights(policy)
        self.generator.push_weights()

    def push_in_flight(self, policy: nn.Module) -> bool:
        """The generator's push while its servers sample (`in_flight_push`); the snapshot a checkpoint keeps stays
        the round's start."""
        if self.in_flight_push is None:
            return False
        self.in_flight_push()
        return True

    def reseed(self, round_seed: int) -> None:
        self.generator.reseed(round_seed)

    def use_threads(self, threads: int) -> None:
        """The engine's CPU threads while it samples beside the trainer (servers keep their own)."""
        self.generator.use_engine_threads(threads)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self._weights)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Push a checkpoint's snapshot: the policy's trainable parameters hold it during the push, then get their
        own values back. A sharded parameter takes its shard of the whole tensor every process loaded (every
        process runs this, in the same order: the push is collective too)."""
        params = dict(self.generator.policy.named_parameters(remove_duplicate=False))
        check_saved_weights([name for name, p in params.items() if p.requires_grad], weights)
        current = {name: params[name].detach().clone() for name in weights}
        for name, tensor in weights.items():
            param = params[name]
            if isinstance(param, DTensor):
                tensor = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
            param.copy_(tensor)
        try:
            self.generator.push_weights()
        finally:
            for name, tensor in current.items():
                params[name].copy_(tensor)
        self._weights = {name: tensor.detach().clone() for name, tensor in weights.items()}


def trainable_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the policy's trainable parameters, by name: whole tensors, a sharded one (`trainer=fsdp`)
    gathered from every process (a collective: every process calls this, on its trainer thread, in order)."""
    weights = {}
    for name, p in policy.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            tensor = p.detach()
            weights[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).to("cpu", copy=True)
    return weights
