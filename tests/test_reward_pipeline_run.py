"""End to end on the tiny random model: a reward of several terms logs each term beside the total, and the
pipeline's state (an EMA baseline) travels in the checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.train import build_run


def test_each_reward_term_is_logged_beside_the_total_and_ema_state_is_checkpointed(tiny_cfg):
    cfg = tiny_cfg(
        "eval.enabled=false",
        "+reward.terms.fmt._target_=grpo_lightning.rewards.AnswerFormat",
        "+reward.terms.fmt.weight=0.5",
        "+reward.terms.overlong._target_=grpo_lightning.rewards.OverlongPenalty",
        "+reward.transforms.clip._target_=grpo_lightning.reward_transforms.Clip",
        "+reward.transforms.clip.low=-0.5",
        "~reward.group_transforms.normalize",
        "+reward.group_transforms.ema._target_=grpo_lightning.reward_transforms.EMABaseline",
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
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("RolloutCallback"))
    ema = state["ranks"][0]["reward"]["reward.group_transforms.ema"]
    assert ema["rounds"] == 2 and isinstance(ema["value"], float)


@pytest.mark.parametrize(
    ("override", "new_key"),
    [
        ("reward.format_bonus=0.2", "reward.terms.gsm8k.format_bonus"),
        ("loss.scale_rewards=none", "reward.group_transforms.normalize.scale"),
    ],
)
def test_cli_names_the_new_key_of_an_old_override(tmp_path, override, new_key):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning", override, "dry_run=true", f"paths.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {override.split('=')[0]} has moved: use {new_key} ")
