"""An overlapped vLLM run (the engine in a process of its own) killed and resumed through the CLI: `make test-vllm`
(marker `vllm`). In a file of its own so that `pytest -n 2 --dist loadfile` runs it beside tests/test_vllm.py: it
is a third of the vLLM tier's time. The model (fixture `llama_dir`, tests/conftest.py) is tests/test_vllm.py's."""

from __future__ import annotations

import time

import pytest

from tests.test_vllm import _vllm

pytestmark = pytest.mark.vllm


def test_an_overlapped_vllm_run_killed_and_resumed_ends_bitwise_where_an_uninterrupted_one_ends(tmp_path, llama_dir):
    """Through the CLI, as tests/test_resume.py does for the HF engine: SIGKILL in the middle of round 2 (the engine
    process, its pipe closed, ends with it), then resume; and a run extended past its last round, whose checkpoint
    holds the snapshot's weights, which the new engine process gets back before it samples that round."""
    from tests.test_resume import assert_bitwise_equal, final_state, finish, start, wait_for

    _vllm()
    args = [
        "generator=vllm", "model=local", f"model.source.path={llama_dir}", "trainer.max_epochs=4",
        "trainer.enable_progress_bar=false", "generator.max_new_tokens=16", "generator.max_model_len=512",
        "generator.kv_cache_gib=0.25", "+generator.engine_kwargs.enforce_eager=true", "~reward.terms.gsm8k",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward", "optim.optimizer.lr=1e-2",
        "eval.enabled=false", "rollout.max_staleness=1", "variant=storpo", "variant.min_steps=1",
    ]  # fmt: skip
    finish(start(tmp_path / "whole", *args))
    whole = final_state(tmp_path / "whole")
    proc = start(tmp_path / "killed", *args)
    round_s = wait_for(tmp_path / "killed" / "checkpoints" / "last.ckpt", proc, writes=2)
    time.sleep(0.5 * round_s)
    assert proc.poll() is None, "the run finished before the kill"
    proc.kill()
    proc.wait()
    assert "resuming from" in finish(start(tmp_path / "killed", *args, "ckpt_path=last"))
    assert_bitwise_equal(whole, final_state(tmp_path / "killed"), context="killed in round 2")
    finish(start(tmp_path / "extended", *args, "trainer.max_epochs=2"))
    finish(start(tmp_path / "extended", *args, "ckpt_path=last"))
    assert_bitwise_equal(whole, final_state(tmp_path / "extended"), context="extended from 2 rounds to 4")
