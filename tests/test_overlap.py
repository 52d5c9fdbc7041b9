"""Overlapped rounds end to end on the tiny model (`rollout.max_staleness` >= 1; docs/overlap.md).

Truth: the sequential run. With lr=0 the weights never change, so sampling round k+1 beside round k's training
(from the weights round k started with) must give exactly the rollouts the sequential run samples after round k
trained: the same token ids, generator log-probs and rewards, round by round, for every variant and with dynamic
sampling. `generator.seed_per_prefix=true` gives both runs the same random numbers (the sequential engine seeds
the global RNG per prefix, the overlapped copy a generator of its own with the same seed), and the sampler gets
as many threads as the sequential run samples with, so float rounding is the same too.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.distributed import derive_seed
from grpo_lightning.generation.hf import HFGenerator

pytestmark = pytest.mark.usefixtures("two_torch_threads")  # a share of threads to give back (tests/conftest.py)

ROUNDS = 3
COMMON = [
    f"trainer.max_epochs={ROUNDS}",
    "generator.seed_per_prefix=true",
    "eval.enabled=false",
    "optim.optimizer.lr=0",
]
SETUPS = {
    "grpo": ["data.dynamic_sampling.enabled=false"],
    "storpo": ["variant=storpo", "variant.min_steps=1"],
    "dynamic_sampling": [
        "~reward.terms.vowels",
        "+reward.terms.even._target_=tests.helpers.VowelFractionOnEvenAnswers",
        "data.dynamic_sampling.max_extra_batches=3",
    ],
}


class RoundRecorder(L.Callback):
    """Each round's rollouts as served, and its logged round metrics, at the round's start."""

    def __init__(self) -> None:
        self.rounds: list[list[tuple]] = []
        self.staleness: list[float] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        """The trainable weights each round starts training with."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        loop = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutLoop")
        served = trainer.datamodule.round
        self.rounds.append([(r.completion_ids, r.gen_logprobs, r.reward, r.group_id) for r in served.rollouts])
        self.staleness.append(loop.round_metrics["rollout/staleness"])
        policy = pl_module.policy
        self.weights.append({n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad})


def run_and_record(tiny_cfg, *overrides: str) -> tuple[RoundRecorder, dict, object]:
    # the sampler gets as many threads as the sequential run samples with (read here: the test's count)
    run = build_run(tiny_cfg(*COMMON, f"rollout.sampler_threads={torch.get_num_threads()}", *overrides))
    recorder = RoundRecorder()
    run.trainer.callbacks.append(recorder)
    metrics = run.fit()
    return recorder, metrics, run


@pytest.mark.parametrize("setup", SETUPS)
def test_at_lr0_overlapped_rounds_sample_exactly_the_sequential_rollouts(tiny_cfg, setup):
    sequential, _, _ = run_and_record(tiny_cfg, *SETUPS[setup])
    overlapped, metrics, run = run_and_record(tiny_cfg, *SETUPS[setup], "rollout.max_staleness=1")
    assert len(sequential.rounds) == len(overlapped.rounds) == ROUNDS
    for k, (a, b) in enumerate(zip(sequential.rounds, overlapped.rounds, strict=True)):
        assert a == b, f"round {k}"
    assert sequential.staleness == [0.0] * ROUNDS
    assert overlapped.staleness == [0.0] + [1.0] * (ROUNDS - 1)  # round 0 from theta_0, then one step behind
    distinct = {tuple(ids) for round_ in overlapped.rounds for ids, *_ in round_}
    assert len(distinct) > ROUNDS  # sampled completions, not one repeated
    if setup == "dynamic_sampling":  # the prompt stream advanced the same way (batches drawn per round)
        assert metrics["rollout/ds_prompts_consumed"] > 0
    assert torch.get_num_threads() == run.rollout_loop.background.share.total  # given back after the run


def test_staleness_is_the_optimizer_steps_of_the_round_trained_meanwhile(tiny_cfg):
    """Two passes a round, one optimizer step each: round k+1 is sampled two steps before it trains."""
    recorder, metrics, run = run_and_record(
        tiny_cfg, "optim.optimizer.lr=1e-3", "data.num_iterations=2", "rollout.max_staleness=2"
    )
    assert run.trainer.global_step == 2 * ROUNDS
    assert recorder.staleness == [0.0, 2.0, 2.0]
    assert metrics["rollout/staleness"] == 2.0


def test_round_k_plus_1_is_sampled_from_the_weights_round_k_started_training_with(tiny_cfg):
    """The truth: a plain engine (no copy, no worker) on the weights recorded at each round's start, seeded with
    the round's seed, samples round k+1 again; on the weights round k+1 starts with it samples something else."""
    recorder, _, run = run_and_record(
        tiny_cfg, "optim.optimizer.lr=1e-2", "rollout.max_staleness=1", "data.dynamic_sampling.enabled=false"
    )
    loop, cfg = run.rollout_loop, run.cfg

    def resample(weights: dict[str, torch.Tensor], round_index: int) -> list[tuple]:
        policy = copy.deepcopy(run.module.policy)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name in weights:
                    p.copy_(weights[name])
        plain = HFGenerator(
            policy,
            loop.tokenizer,
            max_new_tokens=cfg.generator.max_new_tokens,
            temperature=cfg.generator.temperature,
            seed_per_prefix=True,
            generation_settings=loop.generator.generation_settings,
        )
        plain.reseed(derive_seed(cfg.seed, "round", round_index))
        prompts = run.datamodule.prompts_for_round(round_index, loop.tokenizer)
        rollouts = loop.sampler.variant.generate_rollouts(plain, prompts, loop.reward_fn, loop.decode)
        return [(r.completion_ids, r.gen_logprobs, r.reward, r.group_id) for r in rollouts]

    differs = []
    for k in range(ROUNDS - 1):
        assert recorder.rounds[k + 1] == resample(recorder.weights[k], k + 1), f"round {k + 1}"
        differs.append(recorder.rounds[k + 1] != resample(recorder.weights[k + 1], k + 1))
    assert any(differs)  # the weights moved enough to change samples: the check has teeth
