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
