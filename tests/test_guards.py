"""Non-finite guard and reward robustness: a bad step or a buggy reward is counted, never fatal by itself."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.errors import TrainingStopped
from grpo_lightning.rewards.pipeline import pipeline_from_function
from tests.helpers import FlakyReward


class Snapshots(L.Callback):
    """Trainable parameters and AdamW step counts at the end of every round."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.adam_steps: list[list[float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        named = [(n, p) for n, p in pl_module.policy.named_parameters() if p.requires_grad]
        self.params.append({n: p.detach().clone() for n, p in named})
        state = trainer.optimizers[0].state
        self.adam_steps.append([float(state[p]["step"]) for _, p in named if p in state])


def poison(run, rounds: set[int], how: str) -> None:
    """Make the first micro-batch's loss (or one gradient) NaN in the given rounds."""
    module = run.module
    if how == "loss":
        original = module.training_step

        def training_step(batch, batch_idx):
            loss = original(batch, batch_idx)
            return loss * float("nan") if module.current_epoch in rounds and batch_idx == 0 else loss

        module.training_step = training_step
    else:

        class NaNGrad(L.Callback):
            def on_after_backward(self, trainer, pl_module):
                if trainer.current_epoch in rounds:
                    next(p for p in pl_module.parameters() if p.grad is not None).grad[0].fill_(float("inf"))

        run.trainer.callbacks.append(NaNGrad())


@pytest.mark.parametrize("how", ["loss", "gradient"])
def test_non_finite_step_is_skipped_counted_and_training_continues(tiny_cfg, how):
    run = build_run(tiny_cfg("trainer.max_epochs=3", "eval.enabled=false"))
    snaps = Snapshots()
    run.trainer.callbacks.append(snaps)
    poison(run, {1}, how)
    metrics = run.fit()
    before, during, after = snaps.params
    assert all(torch.equal(before[n], during[n]) for n in before)  # round 1's step changed nothing
    assert snaps.adam_steps[0] == snaps.adam_steps[1]  # not even Adam's step count
    assert any(not torch.equal(during[n], after[n]) for n in during)  # round 2 trained again
    assert snaps.adam_steps[2][0] == snaps.adam_steps[1][0] + 1
    assert run.module.skipped_steps == 1 and metrics["train/skipped_steps"] == 1.0
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))


def test_too_many_non_finite_steps_in_a_row_stop_with_a_checkpoint(tiny_cfg):
    cfg = tiny_cfg("trainer.max_epochs=5", "eval.enabled=false", "guard.max_consecutive_skipped_steps=2")
    run = build_run(cfg)
    poison(run, {1, 2, 3, 4}, "loss")
    with pytest.raises(TrainingStopped, match=r"2 optimizer steps in a row .*max_consecutive_skipped_steps=2"):
        run.fit()
    ckpt = torch.load(f"{cfg.paths.output_dir}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 2 and ckpt["grpo_lightning"]["skipped_steps"] == 2  # stopped after rounds 1 and 2


def test_a_failing_reward_scores_zero_and_is_counted(caplog):
    reward = pipeline_from_function(FlakyReward())
    with caplog.at_level(logging.ERROR):
        scores = [reward(text, "") for text in ["abc", "ab", "abcdef", "a"]]  # lengths 3 and 6 raise
    assert scores == [0.0, 0.5, 0.0, 1.0]
    assert reward.pop_errors() == 2 and reward.pop_errors() == 0 and reward.total_errors == 2
    assert len(caplog.records) == 1 and "ZeroDivisionError" in caplog.records[0].getMessage()  # first one only


def test_a_reward_that_raises_on_some_samples_does_not_stop_the_run(tiny_cfg):
    run = build_run(tiny_cfg("reward.terms.vowels._target_=tests.helpers.FlakyReward", "eval.enabled=false"))
    metrics = run.fit()
    assert metrics["rollout/reward_errors"] >= 1  # the last round's count
    assert run.trainer.current_epoch == 2  # both rounds trained
