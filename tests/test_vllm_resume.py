"""An overlapped vLLM run (the engine in a process of its own) extended, killed and resumed through the CLI:
`make test-vllm` (marker `vllm`). In a file of its own so that `pytest -n 2 --dist loadfile` runs it beside
tests/test_vllm.py: it is a third of the vLLM tier's time. The model (fixture `llama_dir`, tests/conftest.py) is
tests/test_vllm.py's."""

from __future__ import annotations

import time

import pytest

from tests.test_vllm import _vllm

pytestmark = pytest.mark.vllm


def test_an_overlapped_vllm_run_extended_then_killed_and_resumed_ends_bitwise_where_an_uninterrupted_one_ends(
    tmp_path, llama_dir
):
    """Through the CLI, as tests/test_resume.py does for the HF engine, one run through both paths a resume takes:
    a run of one round extended to five (its checkpoint holds the snapshot's weights, which the new engine process
    gets back before it samples round 2), SIGKILLed in the middle of round 4 while round 5 is sampled beside it
    (the engine process, its pipe closed, ends with it), then resumed. A fault on either path changes the weights
    every later round trains, so the final state differs from the uninterrupted run's. The kill lands half of
    round 3's own length after round 3 ends, so a run slowed by other work is still killed inside round 4."""
    from tests.test_resume import assert_bitwise_equal, final_state, finish, start, wait_for

    _vllm()
    args = [
        "generator=vllm", "model=local", f"model.source.path={llama_dir}", "trainer.max_epochs=5",
        "trainer.enable_progress_bar=false", "generator.max_new_tokens=16", "generator.max_model_len=512",
        "generator.kv_cache_gib=0.25", "+generator.engine_kwargs.enforce_eager=true", "~reward.terms.gsm8k",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward", "optim.optimizer.lr=1e-2",
        "eval.enabled=false", "rollout.max_staleness=1", "variant=storpo", "variant.min_steps=1",
    ]  # fmt: skip
    finish(start(tmp_path / "whole", *args))
    whole = final_state(tmp_path / "whole")
    run_dir = tmp_path / "extended"
    finish(start(run_dir, *args, "trainer.max_epochs=1"))
    proc = start(run_dir, *args, "ckpt_path=last")
    round_s = wait_for(run_dir / "checkpoints" / "last.ckpt", proc, writes=3)  # as round 1 left it; rounds 2, 3
    time.sleep(0.5 * round_s)
    assert proc.poll() is None, "the run finished before the kill"
    proc.kill()
    proc.wait()
    assert "resuming from" in finish(start(run_dir, *args, "ckpt_path=last"))
    assert_bitwise_equal(whole, final_state(run_dir), context="extended from 1 round to 5, killed in round 4")
