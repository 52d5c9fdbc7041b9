"""generator=vllm_server against real `vllm serve` servers on 127.0.0.1 (vLLM's CPU build) with the faults of servers
shared between runs: a server of another model's weights, a second run on a claimed server, a push a killed run
left open, a server behind an API key, a server killed with SIGKILL, and a run killed with SIGKILL. The fake-server
tests (tests/unit/test_vllm_server_trust.py) cover each check's message; these hold them against vLLM itself.

Truths: the trainer's own log-probs (a plain float32 forward); the process table (/proc): every process of a
started server's group, its engine included, is gone after the run or the server ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.vllm import server_claim as claims
from grpo_lightning.generation.vllm.server import VLLMServerGenerator
from grpo_lightning.generation.vllm.server_process import ServerLaunch, launch_args, server_env, start_servers
from grpo_lightning.generation.vllm.server_weights import ServerClient
from tests.processes import group_members, parent_of, wait_gone
from tests.test_vllm import LOGP_DIFF_BOUND, _load, _logp_diff, _prompts, _vllm

pytestmark = pytest.mark.vllm

API_KEY = "test-key-1234"


def launch(model: Path, lora: bool) -> ServerLaunch:
    args = launch_args(
        dtype="float32", seed=0, max_model_len=1024, cpu=True, weight_transfer="grpo_files",
        lora_rank=8 if lora else 0, kv_cache_gib=0.25, extra=["--api-key", API_KEY],
    )  # fmt: skip
    return ServerLaunch(str(model), args, server_env())


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, llama_dir, tokenizer) -> Path:
    """The test model's architecture and tokenizer with other weights."""
    policy = _load(llama_dir)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    folder = tmp_path_factory.mktemp("other-llama")
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_shared_server_is_checked_claimed_kept_and_stopped_whole(tmp_path, llama_dir, other_model, tokenizer):
    """One server (LoRA slots and the file backend, behind --api-key) serving another model's weights."""
    _vllm()
    (server,) = start_servers([launch(other_model, lora=True)], tmp_path / "server", timeout_s=600)
    keys = {"urls": [server.url], "api_key": API_KEY, "transfer_dir": str(tmp_path / "t"), "max_new_tokens": 16,
            "max_prompt_tokens": 256, "request_timeout_s": 60, "temperature": 0.7}  # fmt: skip
    try:
        # an adapter on a base with the policy's tokenizer and architecture but other weights: refused by the probe
        # after the first push (a full push would replace the base: that run trains on its own weights)
        from grpo_lightning.models.lora import LoraSettings, wrap_policy

        adapted = wrap_policy(_load(llama_dir), LoraSettings(r=4), needs_reference=False)[0]
        gen = VLLMServerGenerator(adapted, tokenizer, log_dir=str(tmp_path / "adapter" / "v"), lora_sync="adapter",
                                  **keys)  # fmt: skip
        with pytest.raises(ValueError, match=f"the vLLM server at {server.url} serves other weights") as err:
            gen.sync_weights(adapted)
        print(err.value)
        gen.close()  # its claim released: the next run takes the server at once
        # the served model itself: claimed, pushed, sampled at float32 agreement
        served = _load(other_model)
        run_a = VLLMServerGenerator(served, tokenizer, log_dir=str(tmp_path / "a" / "v"), **keys)
        run_a.sync_weights(served)
        prefixes = _prompts(tokenizer)
        assert _logp_diff(served, prefixes, run_a.generate(prefixes, num_samples=2)) <= LOGP_DIFF_BOUND
        # a second run on the same server: refused at start, naming the first
        with pytest.raises(ValueError, match=f"the vLLM server at {server.url} is in use by another run .*/a on "):
            VLLMServerGenerator(served, tokenizer, log_dir=str(tmp_path / "b" / "v"), **keys)
        # a push left open (a run killed mid-push): the next push finishes it and pushes whole
        ServerClient(server.url, 60, API_KEY).start_weight_update()
        run_a.sync_weights(served)
        assert claims.parse(ServerClient(server.url, 60, API_KEY).weight_version()).pushes == 2
        assert _logp_diff(served, prefixes, run_a.generate(prefixes, num_samples=2)) <= LOGP_DIFF_BOUND
        # the server killed with SIGKILL: its engine processes go with it, and the run stops in one line
        members = [pid for pid in group_members(server.process.pid) if pid != server.process.pid]
        (api,) = [pid for pid in members if parent_of(pid) == server.process.pid]  # the supervisor's child
        os.kill(api, signal.SIGKILL)
        assert wait_gone(server.process.pid) == []
        print(f"server group: {len(members)} processes besides the supervisor before the kill, none after")
        with pytest.raises(EngineFailed, match=f"the vLLM server at {server.url}") as err:
            run_a.generate(prefixes, num_samples=2)
        assert "\n" not in str(err.value)
    finally:
        server.stop()


def test_a_run_killed_with_sigkill_leaves_no_server_behind(tmp_path, llama_dir):
    """The process that started a server is SIGKILLed (no atexit, no finalizer runs): the supervisor sees its
    parent gone and stops the whole group, engine processes included."""
    _vllm()
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from grpo_lightning.generation.vllm.server_process import ServerLaunch, launch_args, server_env, start_servers
        args = launch_args(dtype="float32", seed=0, max_model_len=512, cpu=True, weight_transfer=None, lora_rank=0,
                           kv_cache_gib=0.25, extra=[])
        (server,) = start_servers([ServerLaunch({str(llama_dir)!r}, args, server_env())], Path({str(tmp_path)!r}), 600)
        print(server.process.pid, flush=True)
        time.sleep(600)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(run.stdout.readline())
        assert len(group_members(pgid)) >= 2  # the supervisor, the API server and its engine
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        left = wait_gone(pgid)
        assert left == [], f"still running after the run was killed: {left}"
    finally:
        if run.poll() is None:
            run.kill()


def test_a_server_killed_while_it_samples_beside_training_stops_the_run_and_it_resumes_exactly(tmp_path, llama_dir):
    """Overlapped rounds (`rollout.max_staleness=1`): the run's only server is SIGKILLed while it samples round 3
    beside round 2's training (5 rounds: the last samples nothing beside it). The run stops in one line naming the
    server, with the resume command, within a bounded time, and leaves no process of the server's group behind.
    Resumed from its last checkpoint (written after round 1: it holds round 2's rollouts, sampled stale on purpose,
    and the weights round 3 is sampled from, pushed to new servers before they sample), it ends bitwise where an
    uninterrupted run ends. Truth: the uninterrupted run. The server's log-probs, which vary with its batching by
    about 1e-7, are kept out of the loss (rollout correction off): the tokens it samples are exact, so the weights
    can be compared bit for bit."""
    import time

    from tests.test_resume import assert_bitwise_equal, final_state, finish, start
    from tests.test_vllm import engine_cli_args

    _vllm()
    args = [
        "generator=vllm_server", *engine_cli_args(llama_dir), "trainer.max_epochs=5", "data.prompts_per_round=4",
        "variant.num_generations=4", "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
        "optim.optimizer.lr=1e-2", "eval.enabled=false", "rollout.max_staleness=1",
        "loss.rollout_correction.enabled=false",
    ]  # fmt: skip
    finish(start(tmp_path / "whole", *args))
    whole = final_state(tmp_path / "whole")
    run_dir = tmp_path / "faulted"
    run_dir.mkdir()
    kill = ["+callbacks.kill._target_=tests.helpers.KillServer", "+callbacks.kill.at_round=2",
            f"+callbacks.kill.directory={run_dir}"]  # fmt: skip
    began = time.monotonic()
    out = finish(start(run_dir, *args, *kill), expect=1)
    after_kill = time.time() - (run_dir / "killed_server").stat().st_mtime
    print(f"server killed beside round 2: the run stopped {after_kill:.0f} s later ({time.monotonic() - began:.0f} s)")
    assert after_kill < 120  # round 2's training, then the stop
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the vLLM server at http://127.0.0.1:" in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert f"ckpt_path={run_dir.resolve() / 'checkpoints' / 'last.ckpt'}" in out
    assert wait_gone(int((run_dir / "killed_server").read_text())) == []
    resumed = finish(start(run_dir, *args, "ckpt_path=last"))  # the stale-weight guard aborts (engine_cli_args):
    assert "resuming from" in resumed  # the resumed round, sampled beside training, is stale on purpose
    assert_bitwise_equal(whole, final_state(run_dir), context="server killed beside round 2, resumed")


def test_a_training_process_killed_during_an_overlapped_server_round_stops_the_run_and_it_resumes_exactly(
    tmp_path, llama_dir
):
    """Two training processes share the run's server with overlapped rounds; process 1 is SIGKILLed as round 2
    starts training, while the server samples round 3 for both processes' workers. Process 0 stops in one line
    naming the lost process, with the resume command, within a bounded time, and stops its server whole (the
    worker's requests in flight included). Resumed from its last checkpoint (new server), the run ends bitwise
    where an uninterrupted one ends (rollout correction off: see the test above). Truth: the uninterrupted run."""
    import time

    from tests.forked_cli import cli_run
    from tests.test_resume import ROOT, assert_bitwise_equal, final_state
    from tests.test_vllm import engine_cli_args

    _vllm()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    args = [
        "generator=vllm_server", *engine_cli_args(llama_dir), "trainer=ddp", "trainer.devices=2",
        "trainer.accelerator=cpu", "trainer.max_epochs=4", "data.prompts_per_round=4", "variant.num_generations=4",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward", "optim.optimizer.lr=1e-2",
        "eval.enabled=false", "rollout.max_staleness=1", "loss.rollout_correction.enabled=false",
    ]  # fmt: skip

    def run(run_dir: Path, *extra: str, expect: tuple[int, ...] = (0,)) -> str:
        result = cli_run(f"hydra.run.dir={run_dir}", *args, *extra, cwd=ROOT, env=env, timeout=900)
        out = result.stdout + result.stderr
        assert result.returncode in expect, out[-4000:]
        return out

    run(tmp_path / "whole")
    killed = tmp_path / "killed"
    killed.mkdir()
    began = time.monotonic()
    out = run(killed, "+callbacks.kill._target_=tests.helpers.KillRank", "+callbacks.kill.rank=1",
              "+callbacks.kill.at_round=2", "+callbacks.server._target_=tests.helpers.RecordServerGroup",
              f"+callbacks.server.directory={killed}", expect=(1, -signal.SIGKILL))  # fmt: skip
    # -9: Lightning's launcher SIGKILLs the first process 0-5 s after it sees another die, which may fall while it
    # stops its server (seconds); the line is printed before that, and the server's supervisor stops it anyway
    print(f"process 1 killed beside an overlapped server round: the run ended {time.monotonic() - began:.0f} s in")
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "another training process is gone" in errors[0], out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert f"ckpt_path={killed.resolve() / 'checkpoints' / 'last.ckpt'}" in out
    assert wait_gone(int((killed / "server_group").read_text())) == []
    resumed = run(killed, "ckpt_path=last")
    assert "resuming from" in resumed
    assert_bitwise_equal(final_state(tmp_path / "whole"), final_state(killed), context="process 1 killed, resumed")
