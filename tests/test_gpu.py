"""GPU path (marker `gpu`, deselected by default): the same end-to-end run with trainer=gpu."""

import pytest
import torch

from grpo_lightning.train import build_run

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_run_on_gpu(tiny_cfg):
    run = build_run(tiny_cfg("trainer=gpu", "trainer.max_epochs=2", "trainer.enable_progress_bar=false"))
    metrics = run.fit()
    assert next(run.module.policy.parameters()).is_cuda
    assert metrics["rollout/logp_diff_mean"] < 5e-2  # bf16 autocast in training vs fp32 sampling


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpu_run(tmp_path, strategy):
    """trainer=ddp / trainer=fsdp on two GPUs through the CLI (not yet run: no multi-GPU machine so far)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable, "-m", "grpo_lightning", f"hydra.run.dir={tmp_path}", f"trainer={strategy}",
            "trainer.devices=2", "model=tiny", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
            "~reward.terms.gsm8k", "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
            "eval.num_problems=4",
            "trainer.strategy.auto_wrap_policy.min_num_params=10000" if strategy == "fsdp" else "seed=0",
        ],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
