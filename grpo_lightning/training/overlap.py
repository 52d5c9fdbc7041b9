"""Overlapped rounds: round k+1 is sampled while round k trains (`rollout.max_staleness` >= 1; docs/overlap.md).

Why: a round samples, then trains, and each phase leaves the hardware the other could use idle: on two CPU cores
the decode loop's small matmuls scale poorly to a second thread, and on two devices each idles half the time.
With overlap, round k+1 is sampled during round k's training by an engine copy (`Generator.background_copy`)
holding the weights as they were when round k started training. Round k+1 then trains on rollouts that are the
optimizer steps of round k behind the weights they update: one-step off-policy, as verl's `one_step_off_policy`
recipe, open-instruct's `async_steps` and prime-rl's `max_off_policy_steps` (Noukhovitch et al. 2024,
"Asynchronous RLHF: Faster and More Efficient Off-Policy RL for Language Models", find such bounded staleness
costs little). That lag is the staleness: `rollout/staleness` each round, bounded by `rollout.max_staleness`.

Who does what:

- the rollout loop (rollout_loop.py) snapshots the weights and starts the worker when a round starts training,
  and joins it and installs its round (as a sequential round is installed) when the round ends; the checkpoint
  of round k is written after that, so it holds theta_{k+1} and round k+1's rollouts, and round k+2 is started
  after it from theta_{k+1} with its own seed: a resumed run samples it again, identically;
- `BackgroundSampling` (here): the engine copy, the worker thread, the thread share and the sampler's own process
  group. A thread, not a process: torch releases the GIL in its kernels and the thread count is a per-thread
  setting (`torch.set_num_threads` in the worker, after its lazy initialisation, leaves the trainer's count
  alone and the trainer's leaves the worker's: `BackgroundEngine.use_threads`), so each side
  gets its share of the cores with shared memory and no weight transfer (benchmarks/overlap.py measures it).
  Under DDP the worker's collectives (dynamic sampling's stop decision) go through a gloo group of its own,
  created on every rank in the same order, so they never interleave with the trainer's gradient all-reduce.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grpo_lightning.distributed import group_timeout, is_distributed
from grpo_lightning.generation.base import BackgroundEngine, Generator
from grpo_lightning.schema import check_settings, integer, optional, setting

ABANDON_WAIT_S = 60.0
"""How long a failing run waits for the round being sampled to notice the cancel (one generate call)."""


@dataclass(frozen=True)
class RolloutSettings:
    """`rollout`: whether the next round is sampled while this one trains."""

    max_staleness: int = setting(0, integer(0))
    sampler_threads: int | None = setting(None, optional(integer(1)))

    def __post_init__(self) -> None:
        check_settings(self, "rollout")


def optimizer_steps_per_round(
    prompts_per_round: int, groups_per_micro_batch: int, num_iterations: int, accumulate: int | None, world_size: int
) -> int | None:
    """Optimizer steps one round takes: its micro-batches on one process x passes / micro-batches per step
    (`accumulate` None: the whole round's micro-batches, as `trainer.accumulate_grad_batches: null`); None when
    the numbers do not divide (the data module and `accumulate_grad_batches` name that mistake)."""
    micro_batches, rest = divmod(prompts_per_round, groups_per_micro_batch * world_size)
    per_step = accumulate or micro_batches
    if rest or not micro_batches or (micro_batches * num_iterations) % per_step:
        return None
    return micro_batches * num_iterations // per_step


def staleness_problem(steps: int, max_staleness: int) -> str | None:
    """The bound on one line naming the key, or None: round k+1 lags by round k's `steps` optimizer steps."""
    if max_staleness == 0 or steps <= max_staleness:
        return None
    return (
        f"rollout.max_staleness={max_staleness} is below the {steps} optimizer steps a round takes: round k+1, "
        f"sampled while round k trains, would be {steps} steps stale; raise rollout.max_staleness to {steps}, take "
        "fewer steps per round (data.num_iterations, trainer.accumulate_grad_batches), or set it to 0"
    )


@dataclass(frozen=True)
class ThreadShare:
    """The CPU threads of each side while the sampler runs beside the trainer (None on a GPU: no share)."""

    total: int
    sampler: int
    trainer: int

    @classmethod
    def of(cls, total: int, sampler_threads: int | None) -> ThreadShare:
        sampler = sampler_threads or max(1, total // 2)
        return cls(total=total, sampler=sampler, trainer=max(1, total - sampler))


class BackgroundSampling:
    """One engine copy sampling one round at a time in a worker thread."""

    def __init__(self, engine: BackgroundEngine, share: ThreadShare | None, device: torch.device | None = None) -> None:
        self.engine = engine
        self.share = share
        self.device = device if device is not None else torch.device("cpu")
        """Where the engine copy computes; on a CUDA device the worker enqueues its kernels on a stream of its own."""
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.group = dist.new_group(backend="gloo", timeout=group_timeout()) if is_distributed() else None
        """The worker's process group (every rank builds it, in the same order: at the run's start), bounded as the
        run's own (`trainer.collective_timeout_s`)."""
        self.snapshot_step = 0
        """The optimizer step whose weights the engine holds (the staleness of a round sampled from them)."""
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def snapshot(self, policy: nn.Module, step: int) -> None:
        """The policy's weights now (after `step` optimizer steps) into the engine copy; main thread only."""
        if self.in_flight:
            raise RuntimeError("a round is still being sampled from the previous snapshot")
        self.engine.sync_weights(policy)
        self.snapshot_step = step

    def start(self, round_seed: int, work: Callable[[Generator, Any], Any]) -> None:
        """Sample in the worker: `work(engine, group)` with the engine reseeded for the round."""
        if self.in_flight:
            raise RuntimeError("a round is already being sampled")
        self.engine.reseed(round_seed)
        self.engine.cancel.clear()
        self._result, self._error = None, None
        if self._stream is not None:  # the snapshot's copies, enqueued on this thread's stream, come first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._thread = threading.Thread(target=self._run, args=(work,), name="rollout-sampler", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[Generator, Any], Any]) -> None:
        if self.share is not None:
            self.engine.use_threads(self.share.sampler)  # this thread's own OpenMP count, or the engine process's
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                self._result = work(self.engine, self.group)
        except BaseException as err:  # noqa: BLE001 - re-raised in the trainer's thread by join()
            self._error = err

    def join(self) -> Any:
        """Wait for the round in flight; its result, or its exception raised here."""
        thread, self._thread = self._thread, None
        if thread is None:
            raise RuntimeError("no round is being sampled")
        thread.join()
        if self._stream is not None:  # the next snapshot overwrites what the worker's kernels read
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self._error is not None:
            raise self._error
        return self._result

    def run_now(self, round_seed: int, work: Callable[[Generator, Any], Any]) -> Any:
        """Sample a round with nothing to overlap (the first round, or one a checkpoint did not hold), in the
        worker all the same: its thread count, hence its float rounding, is a background round's."""
        self.start(round_seed, work)
        return self.join()

    def abandon(self, wait_s: float = ABANDON_WAIT_S) -> None:
        """The run failed: end the round in flight at its next generate call, waiting for it at most `wait_s`."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self.engine.cancel.set()
            thread.join(wait_s)

    def trainer_threads(self) -> None:
        """The trainer's share of the threads, for a round's training (also when nothing runs beside it: the
        float rounding of a round's training must not depend on whether a next round is being sampled)."""
        if self.share is not None:
            torch.set_num_threads(self.share.trainer)

    def all_threads(self) -> None:
        if self.share is not None:
            torch.set_num_threads(self.share.total)

    # ---- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The snapshot (a checkpoint with no sampled next round keeps it: the round is sampled from it on resume)."""
        return {"step": self.snapshot_step, "weights": self.engine.weights()}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_weights(state["weights"])
        self.snapshot_step = state["step"]


def background_sampling(generator: Generator, policy: nn.Module, sampler_threads: int | None) -> BackgroundSampling:
    """The engine copy and its worker for this run; the thread share on the CPU only."""
    device = next(policy.parameters()).device
    share = ThreadShare.of(torch.get_num_threads(), sampler_threads) if device.type == "cpu" else None
    return BackgroundSampling(generator.background_copy(), share, device)
