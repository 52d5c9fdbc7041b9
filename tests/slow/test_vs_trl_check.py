"""benchmarks/vs_trl.py --check --tiny: each of the nine loss types (and grpo with the entropy bonus) equals TRL's
GRPOTrainer on one shared batch (the loss and every LoRA gradient), on the random tiny model. TRL is the
benchmark-only `bench` extra: skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "luspo", "vespo", "grpo_entropy")


def test_every_loss_equals_trl_on_one_batch(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "check.json"
    command = [sys.executable, "benchmarks/vs_trl.py", "--check", "--tiny", "--json", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["check"]
    for name in LOSSES:
        r = results[name]
        assert r["same_params"] and r["num_tensors"] > 0, name
        assert abs(r["loss_ours"] - r["loss_trl"]) <= r["loss_tolerance"], name  # 1e-5 relative per token
        assert r["kl_ours"] == pytest.approx(r["kl_trl"], rel=1e-3), name
        assert r["grad_max_abs_diff"] <= 1e-4 * r["grad_max_abs"], name
    assert len({round(results[name]["loss_trl"], 5) for name in LOSSES}) == len(LOSSES)  # all different losses
