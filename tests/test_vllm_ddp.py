"""vLLM under two training processes (CPU, gloo): every DDP rank drives an engine of its own, in a process beside
it (`generator.engine_process`, on by default with several training processes), samples its block of the round's
prompts and takes every weight push. Run by `make test-vllm` (marker `vllm`), on vLLM's CPU build.

Truths: the trainer's own log-probs (each rank's `rollout/logp_diff`, logged as the max over ranks, stays at the
float32 engine-trainer agreement only if that rank's engine holds the weights its trainer just trained), a hand
count of the rewards each process computed (a recording test reward), and the sequential run's staleness record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import group_size_for_variant
from tests.forked_cli import cli_run
from tests.test_ddp import scalars
from tests.test_vllm import LOGP_DIFF_BOUND, REPO, _vllm, engine_cli_args

pytestmark = pytest.mark.vllm

PROMPTS, G, ROUNDS = 4, 4, 3


def ddp_vllm_run(run_dir: Path, llama_dir: Path, *extra: str) -> Path:
    run_dir.mkdir(parents=True)
    args = [
        "generator=vllm",
        *engine_cli_args(llama_dir),
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        f"trainer.max_epochs={ROUNDS}",
        "+generator.engine_kwargs.enforce_eager=true",
        f"data.prompts_per_round={PROMPTS}",
        f"variant.num_generations={G}",
        "+reward.terms.vowels._target_=tests.helpers.RecordingReward",
        f"+reward.terms.vowels.directory={run_dir}",
        "optim.optimizer.lr=1e-2",
        "eval.num_problems=3",  # ranks score 2 and 1 problems, each with its own engine
        f"eval.every_n_rounds={ROUNDS}",
        f"hydra.run.dir={run_dir}",
    ]
    replaced = {o.split("=", 1)[0] for o in extra}  # `extra` replaces a default of the same key
    args = group_size_for_variant([o for o in args if o.split("=", 1)[0] not in replaced] + list(extra))
    result = cli_run(*args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return run_dir


@pytest.mark.parametrize(
    "extra",
    [pytest.param([], id="grpo"), pytest.param(["variant=storpo", "rollout.max_staleness=1"], id="storpo-overlapped")],
)
def test_every_rank_samples_its_share_with_an_engine_that_takes_every_push(tmp_path, llama_dir, extra):
    _vllm()
    run_dir = ddp_vllm_run(tmp_path / "run", llama_dir, *extra)
    # each rank's engine sampled from the weights its trainer had just trained (max over ranks); overlapped
    # rounds after the first are sampled one step earlier on purpose, so only round 0 is fresh there
    worst = scalars(run_dir, "rollout/logp_diff_max")
    print(f"2 ranks, vLLM engine each ({' '.join(extra) or 'grpo'}): rollout/logp_diff_max {worst}")
    fresh = worst if not extra else worst[:1]
    assert len(worst) == ROUNDS and max(fresh) <= 2 * LOGP_DIFF_BOUND
    # both processes scored rollouts, and the logged reward mean is over both
    files = sorted(run_dir.glob("rewards.*"))
    per_process = [[float(x) for x in f.read_text().split()] for f in files]
    assert len(per_process) == 2 and all(len(r) >= ROUNDS * PROMPTS // 2 * G for r in per_process)
    if not extra:  # a plain round: exactly its block of G completions per prompt, once per round
        per_round = PROMPTS // 2 * G
        hand = [
            sum(sum(r[k * per_round : (k + 1) * per_round]) for r in per_process) / (PROMPTS * G) for k in range(ROUNDS)
        ]
        assert scalars(run_dir, "train/reward_mean") == pytest.approx(hand, rel=1e-6)
    else:
        assert scalars(run_dir, "rollout/staleness") == [0.0, 1.0, 1.0]
    metrics = json.loads((run_dir / "final_metrics.json").read_text())
    assert "eval/gsm8k_accuracy" in metrics  # scored by both ranks' engines after the last push


def test_sharded_full_fine_tuning_pushes_every_layer_to_each_rank_engine(tmp_path, llama_dir):
    """trainer=fsdp, full fine-tuning: each rank's engine takes the whole policy, gathered one decoder layer at a
    time by both processes together (grpo_lightning/sharding.py); it samples what the trainer then scores."""
    _vllm()
    run_dir = ddp_vllm_run(tmp_path / "run", llama_dir, "trainer=fsdp", "model.lora.enabled=false",
                           "optim.optimizer.lr=1e-3")  # fmt: skip
    worst = scalars(run_dir, "rollout/logp_diff_max")
    print(f"trainer=fsdp, 2 ranks, vLLM engine each: rollout/logp_diff_max {worst}")
    assert len(worst) == ROUNDS and max(worst) <= 2 * LOGP_DIFF_BOUND
    assert max(scalars(run_dir, "train/grad_norm")) > 0  # the weights moved, so each later round needed the push
