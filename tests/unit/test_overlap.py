"""Overlapped rounds' bookkeeping (training/overlap.py): the staleness bound, the thread share and the worker.

Truths: optimizer steps per round counted by hand from the round's shape; the worker's thread count and RNG
observed from inside the worker; one-line config errors through the CLI's own code.
"""

from __future__ import annotations

import threading

import pytest
import torch

from grpo_lightning.generation.base import BackgroundEngine, SamplingCancelled
from grpo_lightning.training.overlap import (
    BackgroundSampling,
    RolloutSettings,
    ThreadShare,
    optimizer_steps_per_round,
    staleness_problem,
)
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.training.round_sampling import SampledRound
from tests.helpers import StubGenerator
from tests.test_bad_input import assert_clean_failure, cli


@pytest.mark.parametrize(
    ("prompts", "groups_per_mb", "iterations", "accumulate", "world", "steps"),
    [
        (2, 1, 1, None, 1, 1),  # the default: the whole round in one step
        (2, 1, 2, None, 1, 2),  # two passes, one step each
        (4, 1, 1, 2, 1, 2),  # 4 micro-batches, 2 per step
        (4, 2, 2, 1, 1, 4),  # 2 micro-batches x 2 passes, one per step
        (8, 1, 1, 2, 2, 2),  # 2 ranks: 4 micro-batches each, 2 per step
        (8, 2, 3, None, 2, 3),  # 2 ranks x 2 micro-batches, whole pass per step, 3 passes
    ],
)
def test_optimizer_steps_per_round_by_hand(prompts, groups_per_mb, iterations, accumulate, world, steps):
    assert optimizer_steps_per_round(prompts, groups_per_mb, iterations, accumulate, world) == steps


@pytest.mark.parametrize(
    ("prompts", "groups_per_mb", "accumulate", "world"), [(3, 2, None, 1), (4, 1, 3, 1), (2, 1, None, 4)]
)
def test_optimizer_steps_per_round_leaves_shapes_that_do_not_divide_to_their_own_checks(
    prompts, groups_per_mb, accumulate, world
):
    assert optimizer_steps_per_round(prompts, groups_per_mb, 1, accumulate, world) is None


def test_staleness_bound():
    assert staleness_problem(3, 0) is None  # 0: no overlap, nothing to bound
    assert staleness_problem(1, 1) is None and staleness_problem(2, 3) is None
    message = staleness_problem(2, 1)
    assert message is not None and "\n" not in message
    assert message.startswith("rollout.max_staleness=1 is below the 2 optimizer steps a round takes")


@pytest.mark.parametrize(("key", "value"), [("max_staleness", -1), ("sampler_threads", 0)])
def test_settings_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"rollout.{key} must be >= "):
        RolloutSettings(**{key: value})


@pytest.mark.parametrize(
    ("total", "sampler_threads", "expected"),
    [(2, None, (1, 1)), (8, None, (4, 4)), (7, None, (3, 4)), (1, None, (1, 1)), (8, 2, (2, 6)), (2, 2, (2, 1))],
)
def test_thread_share(total, sampler_threads, expected):
    share = ThreadShare.of(total, sampler_threads)
    assert (share.sampler, share.trainer) == expected and share.total == total


class ScriptedCopy(StubGenerator, BackgroundEngine):
    """A background engine whose `generate` records the worker's view: its thread, torch thread count and seed."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel = threading.Event()
        self.synced: list[float] = []
        self.seed = None
        self.snapshot = {"w": torch.zeros(2)}

    def sync_weights(self, policy) -> None:
        self.synced.append(float(policy.weight.detach().sum()))

    def reseed(self, round_seed: int) -> None:
        self.seed = round_seed

    def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
        if self.cancel.is_set():
            raise SamplingCancelled
        return threading.current_thread().name, torch.get_num_threads(), self.seed

    def weights(self):
        return {k: v.clone() for k, v in self.snapshot.items()}

    def load_weights(self, weights) -> None:
        self.snapshot = dict(weights)


@pytest.mark.usefixtures("two_torch_threads")
def test_worker_samples_in_its_own_thread_with_its_thread_share_and_the_round_seed():
    engine = ScriptedCopy()
    background = BackgroundSampling(engine, ThreadShare.of(2, 1))
    before = torch.get_num_threads()
    background.start(1234, lambda e, group: (e.generate([[1]], 2), group))
    (name, threads, seed), group = background.join()
    assert name == "rollout-sampler" and name != threading.current_thread().name
    assert threads == 1 and seed == 1234 and group is None  # one process: no process group
    assert torch.get_num_threads() == before  # the worker's count is its own (a per-thread OpenMP setting)
    assert not background.in_flight


@pytest.mark.usefixtures("two_torch_threads")
def test_trainer_threads_then_all_threads():
    background = BackgroundSampling(ScriptedCopy(), ThreadShare(total=torch.get_num_threads(), sampler=1, trainer=1))
    background.trainer_threads()
    assert torch.get_num_threads() == 1
    background.all_threads()
    assert torch.get_num_threads() == background.share.total


def test_worker_errors_are_raised_by_join_and_snapshots_wait_for_the_round():
    background = BackgroundSampling(ScriptedCopy(), None)
    release = threading.Event()

    def failing(engine, group):
        release.wait(5)
        raise ZeroDivisionError("a reward with a bug")

    background.start(0, failing)
    with pytest.raises(RuntimeError, match="still being sampled"):
        background.snapshot(torch.nn.Linear(2, 2), 0)  # the copy must not change under the worker
    with pytest.raises(RuntimeError, match="already being sampled"):
        background.start(0, failing)
    release.set()
    with pytest.raises(ZeroDivisionError, match="a reward with a bug"):
        background.join()


def test_snapshot_records_the_step_and_the_checkpoint_state_round_trips():
    engine = ScriptedCopy()
    background = BackgroundSampling(engine, None)
    layer = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(layer.weight, 0.5)
    background.snapshot(layer, step=7)
    assert engine.synced == [2.0] and background.snapshot_step == 7
    engine.snapshot = {"w": torch.tensor([1.0, 2.0])}
    state = background.state_dict()
    other = BackgroundSampling(ScriptedCopy(), None)
    other.load_state_dict(state)
    assert other.snapshot_step == 7 and torch.equal(other.engine.snapshot["w"], torch.tensor([1.0, 2.0]))


def test_abandon_cancels_the_round_at_its_next_generate_call():
    engine = ScriptedCopy()
    background = BackgroundSampling(engine, None)
    started, outcome = threading.Event(), []

    def rounds(e, group):
        started.set()
        try:
            while True:
                e.generate([[1]], 1)
        except SamplingCancelled:
            outcome.append("cancelled")
            raise

    background.start(0, rounds)
    started.wait(5)
    background.abandon()
    assert outcome == ["cancelled"] and not background.in_flight


def _sampled() -> SampledRound:
    return SampledRound([], [], [], {}, {}, 0, 0.0, 0)


def test_a_round_staler_than_the_bound_stops_the_run_with_one_line_naming_the_key():
    """The run-time check, before the round touches the trainer (so no trainer is needed here)."""
    loop = RolloutLoop(ScriptedCopy(), None, None, None, None, max_staleness=1)
    with pytest.raises(ValueError, match=r"^rollout.max_staleness=1 is below the 3 optimizer steps") as err:
        loop.finish(None, None, _sampled(), round_index=1, staleness=3)
    assert "\n" not in str(err.value)


def test_a_bound_the_config_breaks_fails_before_loading_with_one_line(tmp_path):
    result = cli(
        f"hydra.run.dir={tmp_path}/run", "model=tiny", "rollout.max_staleness=1", "data.num_iterations=2", cwd=tmp_path
    )
    assert_clean_failure(result, "rollout.max_staleness=1 is below the 2 optimizer steps a round takes", code=2)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
