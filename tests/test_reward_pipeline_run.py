"""End to end on the tiny random model: a reward of several terms logs each term beside the total, and the
pipeline's state (an EMA baseline) travels in the checkpoint."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.train import build_run


def test_each_reward_term_is_logged_beside_the_total_and_ema_state_is_checkpointed(tiny_cfg):
    cfg = tiny_cfg(
        "eval.enabled=false",
        "+reward.terms.fmt._target_=grpo_lightning.rewards.gsm8k.AnswerFormat",
        "+reward.terms.fmt.weight=0.5",
        "+reward.terms.overlong._target_=grpo_lightning.rewards.gsm8k.OverlongPenalty",
        "+reward.transforms.clip._target_=grpo_lightning.rewards.transforms.Clip",
        "+reward.transforms.clip.low=-0.5",
        "~reward.group_transforms.normalize",
        "+reward.group_transforms.ema._target_=grpo_lightning.rewards.transforms.EMABaseline",
    )
    run = build_run(cfg)
    assert run.plan.reward == "1 x vowels + 0.5 x fmt + 1 x overlong -> clip -> ema(scale=none)"
    metrics = run.fit()
    for name in ("vowels", "fmt", "overlong", "total"):
        assert f"reward/{name}_mean" in metrics
    assert metrics["reward/total_mean"] == pytest.approx(metrics["train/reward_mean"])
    assert -1.0 <= metrics["reward/overlong_mean"] <= 0.0 and metrics["reward/fmt_mean"] == 0.0  # no answers
    acc = EventAccumulator(str(Path(cfg.paths.output_dir) / "tensorboard"))
    acc.Reload()
    assert {"reward/vowels_mean", "reward/overlong_mean", "reward/total_mean"} <= set(acc.Tags()["scalars"])
    ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("RolloutLoop"))
    ema = state["ranks"][0]["reward"]["reward.group_transforms.ema"]
    assert ema["rounds"] == 2 and isinstance(ema["value"], float)
