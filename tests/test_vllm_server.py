"""generator=vllm_server against real `vllm serve` servers on 127.0.0.1 (vLLM's CPU build, marker `vllm`): started by
the generator, full weights pushed through vLLM's weight-transfer protocol (the `grpo_files` backend this package
registers in vLLM's registry), adapters loaded at runtime, a restarted server given the weights before it samples,
a killed one dropped from the pool, and two training processes sharing one server.

Truths: the trainer's own log-probs (log_softmax(logits / T) of the HF model, tests/test_vllm.py), stale before a
push and equal to float32 agreement after it; the single-process run on the same prefixes (each request is seeded
from its round and prefix, so two processes sample what one samples).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.generation.vllm.server import VLLMServerGenerator
from grpo_lightning.generation.vllm.server_checks import server_info
from grpo_lightning.generation.vllm.server_process import ServerProcess
from tests.forked_cli import cli_run
from tests.test_ddp import scalars
from tests.test_vllm import LOGP_DIFF_BOUND, REPO, _load, _logp_diff, _prompts, _vllm, engine_cli_args

pytestmark = pytest.mark.vllm

SERVER = {"dtype": "float32", "max_model_len": 1024, "kv_cache_gib": 0.25}


def _perturb(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def test_started_servers_take_full_pushes_and_a_restarted_one_gets_them_before_it_samples(
    tmp_path, llama_dir, tokenizer
):
    _vllm()
    policy = _load(llama_dir)
    gen = VLLMServerGenerator(
        policy, tokenizer, num_servers=2, log_dir=str(tmp_path), max_new_tokens=16, temperature=0.7,
        **SERVER,
    )  # fmt: skip
    try:
        prefixes = _prompts(tokenizer) * 2  # four prefixes, two per server
        assert _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4)) <= LOGP_DIFF_BOUND
        for server in gen.servers:  # both servers sampled
            assert "POST /v1/completions" in server.log_path.read_text()
        # every request is seeded, and vLLM's CPU build stops its engine when a seeded prompt is split across
        # steps: the started servers run without chunked prefill (server_info's own keys), and 8 prompts of 600
        # tokens, more than one step takes, are sampled whole
        info = server_info(gen.clients[0])
        assert info["scheduler_config"]["enable_chunked_prefill"] is False and "cpu" in str(info["device_config"])
        long = [[100 + (7 * i + j) % 1000 for j in range(600)] for i in range(8)]
        assert [len(group) for group in gen.generate(long, num_samples=2)] == [2] * 8
        _perturb(policy, seed=1)
        stale = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
        gen.sync_weights(policy)
        fresh = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
        print(f"vllm_server full push: logp_diff_mean {stale:.3g} before, {fresh:.3g} after, {gen.sync_s[-1]:.2f} s")
        assert fresh <= LOGP_DIFF_BOUND < 0.05 < stale
        # server 1 restarts in place (same URL): it holds the model's own weights again until it is given them
        old = gen.servers[1]
        old.stop()
        restarted = ServerProcess(gen.launches[1], tmp_path / "restarted.log", port=old.port)
        gen.servers[1] = restarted
        restarted.wait_ready(600)
        after_restart = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
        assert after_restart <= LOGP_DIFF_BOUND
        assert "POST /finish_weight_update" in restarted.log_path.read_text()
        # each server's load, under vLLM's own metric names (its /metrics)
        load = gen.engine_metrics()
        assert {"server/0/queue_s_mean", "server/0/preemptions", "server/1/preemptions"} <= load.keys(), load
        assert load["server/0/queue_s_mean"] >= 0 and load["server/0/preemptions"] == 0
        # server 1 killed: the round goes to server 0 with the same seeds, so it samples what both would have
        gen.reseed(3)
        intact = gen.generate(prefixes, num_samples=4)
        restarted.stop()
        gen.reseed(3)
        after_loss = gen.generate(prefixes, num_samples=4)
        assert [[c.token_ids for c in group] for group in after_loss] == [[c.token_ids for c in g] for g in intact]
        assert [c.url for c in gen.pool.live] == [gen.servers[0].url]
    finally:
        gen.close()
    time.sleep(1)
    assert all(not server.alive() for server in gen.servers)  # stopped with the generator


def cli(run_dir: Path, llama_dir: Path, *extra: str) -> Path:
    run_dir.mkdir(parents=True)
    args = [
        "generator=vllm_server", *engine_cli_args(llama_dir), "trainer.max_epochs=2",
        "data.prompts_per_round=4", "variant.num_generations=4",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
        # SGD: the update is linear in the gradient, so one process and two agree to float rounding
        "optim.optimizer._target_=torch.optim.SGD", "~optim.optimizer.betas", "optim.optimizer.lr=1.0",
        "eval.num_problems=3", "eval.every_n_rounds=100", "generator.lora_sync=adapter", "model.lora.r=4",
        "+callbacks.dump._target_=tests.helpers.DumpTrainableParams", f"+callbacks.dump.directory={run_dir}",
        f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip
    result = cli_run(*args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return run_dir


@pytest.mark.parametrize("staleness", [0, 1], ids=["sequential", "overlapped"])
def test_two_training_processes_share_one_server_and_train_what_one_process_trains(tmp_path, llama_dir, staleness):
    """Adapters loaded at runtime each round; the server started by rank 0, its URL inherited by rank 1. Overlapped:
    each process's worker samples round 1 while round 0 trains, from the adapter pushed as round 0 started."""
    _vllm()
    overlap = f"rollout.max_staleness={staleness}"
    single = cli(tmp_path / "single", llama_dir, overlap)
    ddp = cli(tmp_path / "ddp", llama_dir, "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", overlap)
    for run in (single, ddp):
        worst = scalars(run, "rollout/logp_diff_max")
        assert len(worst) == 2
        if staleness == 0:
            assert max(worst) <= 2 * LOGP_DIFF_BOUND  # every rank sampled its trainer's weights
        else:  # round 1 was sampled from the adapter round 0 started with
            assert worst[0] <= 2 * LOGP_DIFF_BOUND < worst[1]
            assert scalars(run, "rollout/staleness") == [0.0, 1.0]
    assert scalars(ddp, "train/reward_mean") == pytest.approx(scalars(single, "train/reward_mean"), rel=1e-6)
    reference, rank0, rank1 = (torch.load(p) for p in (single / "rank0.pt", ddp / "rank0.pt", ddp / "rank1.pt"))
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    for name in reference:
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(reference[n].abs().max() > 0 for n in reference if "lora_B" in n)  # it trained
    assert len(list((ddp / "vllm_server").glob("*.log"))) == 1  # one server for both processes


def test_sharded_training_pushes_merged_weights_gathered_layer_by_layer(tmp_path, llama_dir):
    """trainer=fsdp on 2 processes, lora_sync=merge: rank 0 pushes the LoRA-merged weights, gathered one decoder
    layer at a time with rank 1 taking part in every gather; the shared server samples from them every round."""
    _vllm()
    run = cli(tmp_path / "fsdp", llama_dir, "trainer=fsdp", "trainer.devices=2", "trainer.accelerator=cpu",
              "generator.lora_sync=merge")  # fmt: skip
    worst = scalars(run, "rollout/logp_diff_max")
    print(f"trainer=fsdp, one server, merged pushes: rollout/logp_diff_max {worst}")
    assert len(worst) == 2 and max(worst) <= 2 * LOGP_DIFF_BOUND
    rank0, rank1 = torch.load(run / "rank0.pt"), torch.load(run / "rank1.pt")
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    assert any(rank0[n].abs().max() > 0 for n in rank0 if "lora_B" in n)  # it trained: round 1 needed the push


def test_sharded_training_with_overlapped_rounds_trains_what_ddp_trains(tmp_path, llama_dir):
    """trainer=fsdp with `rollout.max_staleness=1`: as round k starts training, every process takes part in
    gathering the merged weights rank 0 pushes (and in the snapshot a checkpoint keeps), and the server samples
    round k+1 beside the sharded training. Truth: trainer=ddp, overlapped, on a server of its own. Round 2 is
    sampled from the weights pushed as round 1 started (the first pushed weights that differ from the model's
    own), so a push that failed under sharding would sample other tokens there, and train other weights."""
    _vllm()
    common = ("trainer.devices=2", "trainer.accelerator=cpu", "generator.lora_sync=merge", "rollout.max_staleness=1",
              "trainer.max_epochs=3")  # fmt: skip
    fsdp = cli(tmp_path / "fsdp", llama_dir, "trainer=fsdp", *common)
    ddp = cli(tmp_path / "ddp", llama_dir, "trainer=ddp", *common)
    assert scalars(fsdp, "rollout/staleness") == scalars(ddp, "rollout/staleness") == [0.0, 1.0, 1.0]
    assert scalars(fsdp, "train/reward_mean") == pytest.approx(scalars(ddp, "train/reward_mean"), rel=1e-6)
    reference, rank0, rank1 = (torch.load(p) for p in (ddp / "rank0.pt", fsdp / "rank0.pt", fsdp / "rank1.pt"))
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    for name in reference:  # 3 SGD steps at lr=1: reductions in another order differ by up to 5e-6 here
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    assert any(reference[n].abs().max() > 0 for n in reference if "lora_B" in n)  # it trained


def _server_run(run_dir: Path, llama_dir: Path, *overrides: str):
    """A 3-round in-process run on a server it starts, every round's rollouts recorded (tests/test_overlap.py)."""
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg
    from tests.test_overlap import RoundRecorder

    args = [
        "generator=vllm_server", *engine_cli_args(llama_dir), "trainer.max_epochs=3", "data.prompts_per_round=4",
        "variant.num_generations=4", "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
        "eval.enabled=false", *overrides,
    ]  # fmt: skip
    run = build_run(make_cfg(run_dir, args))
    recorder = RoundRecorder()
    run.trainer.callbacks.append(recorder)
    try:
        metrics = run.fit()
    finally:
        run.rollout_loop.generator.close()
    return recorder, metrics, run


def test_overlapped_rounds_on_a_server_sample_exactly_the_sequential_rollouts_at_lr0(tmp_path, llama_dir):
    """`rollout.max_staleness=1`: the server samples round k+1 while round k trains, from the weights pushed as
    round k started training. Truth: the sequential run on a server of its own. At lr=0 the weights never change
    and every request is seeded from its round and prefix, so both runs sample the same rollouts, round by round;
    the overlapped rounds after the first are one step stale."""
    _vllm()
    sequential, _, _ = _server_run(tmp_path / "sequential", llama_dir, "optim.optimizer.lr=0")
    overlapped, metrics, run = _server_run(
        tmp_path / "overlapped", llama_dir, "optim.optimizer.lr=0", "rollout.max_staleness=1"
    )
    assert len(sequential.rounds) == len(overlapped.rounds) == 3
    for k, (a, b) in enumerate(zip(sequential.rounds, overlapped.rounds, strict=True)):
        assert [r[0] for r in a] == [r[0] for r in b], f"round {k}: token ids"
        assert [r[2:] for r in a] == [r[2:] for r in b], f"round {k}: rewards and groups"
        for (_, x, *_), (_, y, *_) in zip(a, b, strict=True):  # batched otherwise: float32 sums in another order
            assert x == pytest.approx(y, rel=1e-5, abs=1e-5), f"round {k}: the server's log-probs"
    assert sequential.staleness == [0.0, 0.0, 0.0] and overlapped.staleness == [0.0, 1.0, 1.0]
    assert len({tuple(ids) for round_ in overlapped.rounds for ids, *_ in round_}) > 3  # sampled, not repeated
    assert metrics["rollout/logp_diff_mean"] <= LOGP_DIFF_BOUND  # lr=0: stale weights are the same weights
    assert all(not server.alive() for server in run.rollout_loop.generator.servers)


def test_pushes_in_flight_pause_the_server_with_its_requests_kept_and_sample_exactly_the_sequential_rollouts_at_lr0(
    tmp_path, llama_dir
):
    """`generator.push_in_flight`, rounds of 2 optimizer steps (`rollout.max_staleness=2`): after the first step of
    round k the weights are pushed while the server samples round k+1, inside `/pause?mode=keep` ... `/resume`.
    Truth: the sequential run at lr=0, where every push carries the same weights, so a pause that lost, restarted
    or reordered a kept request would sample other tokens; every request is seeded from its round and prefix."""
    _vllm()
    steps = ("optim.optimizer.lr=0", "trainer.accumulate_grad_batches=2", "data.groups_per_micro_batch=1")
    sequential, _, _ = _server_run(tmp_path / "sequential", llama_dir, *steps)
    overlapped, _, run = _server_run(
        tmp_path / "in_flight", llama_dir, *steps, "rollout.max_staleness=2", "generator.push_in_flight=true"
    )
    for k, (a, b) in enumerate(zip(sequential.rounds, overlapped.rounds, strict=True)):
        assert [r[0] for r in a] == [r[0] for r in b], f"round {k}: token ids"
        for (_, x, *_), (_, y, *_) in zip(a, b, strict=True):  # batched otherwise: float32 sums in another order
            assert x == pytest.approx(y, rel=1e-5, abs=1e-5), f"round {k}: the server's log-probs"
    assert overlapped.staleness == [0.0, 2.0, 2.0]
    log = (tmp_path / "in_flight" / "vllm_server" / "vllm_server0.log").read_text()
    # rounds 1 and 2 were sampled beside a round of two steps: one push each after its first step
    assert log.count("POST /pause?mode=keep") == log.count("POST /resume") == 2
    assert scalars(tmp_path / "in_flight", "rollout/pushes_in_flight") == [0.0, 1.0, 1.0]
    assert all(not server.alive() for server in run.rollout_loop.generator.servers)
