"""Two DDP processes (CPU, gloo) through the real CLI against one process on the same prompts and batch.

Truths: the single-process run (SGD) (`generator.seed_per_prefix=true` makes each prompt's samples independent of
batching and rank, so both runs train on identical rollouts), each rank's own parameters (dumped by a test
callback), and a hand count of every reward both processes computed (a recording test reward).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import group_size_for_variant
from tests.forked_cli import ENABLED as FORKED_CLI
from tests.forked_cli import cli_run

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 2
PROMPTS = 4
G = 4


def run(run_dir: Path, devices: int, *extra: str, real_ranks: bool = False) -> dict:
    """One CLI run; rank 0 forked past its imports (tests/forked_cli.py), and rank 1 too unless `real_ranks`: then
    Lightning starts it as a real process, with a `str` hash seed of its own, as ranks have outside the tests."""
    run_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if real_ranks:
        env["GRPO_LIGHTNING_TEST_FORKED_RANKS"] = "0"
    env.pop("HYDRA_FULL_ERROR", None)
    result = cli_run(*run_overrides(run_dir, devices, *extra), cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"dir": run_dir, "stdout": result.stdout, "stderr": result.stderr}


def run_overrides(run_dir: Path, devices: int, *extra: str) -> list[str]:
    """The runs' shared overrides (`extra` replaces a default override of the same key, which Hydra would keep
    silently), with `trainer=ddp` on `devices` CPU processes when there are several."""
    overrides = [
        f"hydra.run.dir={run_dir}",
        "model=tiny",
        f"trainer.max_epochs={ROUNDS}",
        "generator.max_new_tokens=12",
        "generator.seed_per_prefix=true",
        "trainer.enable_progress_bar=false",
        "~reward.terms.gsm8k",
        "+reward.terms.vowels._target_=tests.helpers.RecordingReward",
        f"+reward.terms.vowels.directory={run_dir}",
        # SGD: the update is linear in the gradient, so float-rounding differences stay float-sized. (Adam's first
        # steps are ~lr * sign(g): a gradient entry near 0 flips with rounding and moves by a whole lr.)
        "optim.optimizer._target_=torch.optim.SGD",
        "~optim.optimizer.betas",
        "optim.optimizer.lr=1.0",
        f"data.prompts_per_round={PROMPTS}",
        f"variant.num_generations={G}",
        "eval.num_problems=3",  # not a multiple of 2: ranks score 2 and 1 problems
        "eval.every_n_rounds=100",
        "+callbacks.dump._target_=tests.helpers.DumpTrainableParams",
        f"+callbacks.dump.directory={run_dir}",
        "+callbacks.started._target_=tests.helpers.RecordHowRankStarted",
        f"+callbacks.started.directory={run_dir}",
    ]
    if devices > 1:
        overrides += ["trainer=ddp", f"trainer.devices={devices}", "trainer.accelerator=cpu"]
    replaced = {o.split("=", 1)[0] for o in extra}
    return group_size_for_variant([o for o in overrides if o.split("=", 1)[0] not in replaced] + list(extra))


def scalars(run_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(next((run_dir / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


@pytest.fixture(scope="module", params=["grpo", "dapo"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    extra = [f"loss={request.param}"]
    real_ranks = request.param == "grpo"  # one pair with ranks whose `str` hashing differs (tests/forked_cli.py)
    if request.param == "grpo":
        extra.append("probe=[gns,entropy]")  # the probes' DDP paths; they never change training
    single, ddp = run(root / "single", 1, *extra), run(root / "ddp", 2, *extra, real_ranks=real_ranks)
    return {"single": single, "ddp": ddp, "loss": request.param}


def test_ranks_hold_identical_parameters_equal_to_one_process(runs):
    ddp, single = runs["ddp"]["dir"], runs["single"]["dir"]
    rank0, rank1 = torch.load(ddp / "rank0.pt"), torch.load(ddp / "rank1.pt")
    reference = torch.load(single / "rank0.pt")
    assert rank0.keys() == rank1.keys() == reference.keys()
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)  # DDP keeps the replicas bitwise equal
    for name in reference:  # same rollouts, same effective batch: equal up to the order of float sums
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    lora_b = [n for n in reference if "lora_B" in n]
    assert any(reference[n].abs().max() > 0 for n in lora_b)  # it trained (LoRA B starts at zero)


def test_rank_one_is_forked_except_in_the_pair_kept_real(runs):
    """tests/forked_cli.py forks the ranks Lightning starts; the grpo pair keeps real ones, whose `str` hashing
    differs from rank 0's, and both pairs are held to the same truths."""
    started = {r: (runs["ddp"]["dir"] / f"rank{r}.started").read_text() for r in (0, 1)}
    if not FORKED_CLI:
        assert started == {0: "real", 1: "real"}
    else:
        assert started == {0: "forked", 1: "real" if runs["loss"] == "grpo" else "forked"}


def test_reward_mean_is_over_all_ranks_and_logged_once(runs):
    ddp = runs["ddp"]["dir"]
    files = sorted(ddp.glob("rewards.*"))
    assert len(files) == 2  # both processes scored rollouts
    per_process = [[float(x) for x in f.read_text().split()] for f in files]
    per_rank_round = PROMPTS // 2 * G
    assert all(len(rewards) == ROUNDS * per_rank_round for rewards in per_process)
    hand = [
        sum(sum(r[k * per_rank_round : (k + 1) * per_rank_round]) for r in per_process) / (PROMPTS * G)
        for k in range(ROUNDS)
    ]
    logged = scalars(ddp, "train/reward_mean")
    assert len(logged) == ROUNDS  # once per round, not once per rank
    assert logged == pytest.approx(hand, rel=1e-6)
    assert scalars(runs["single"]["dir"], "train/reward_mean") == pytest.approx(hand, rel=1e-6)  # same rollouts


def test_only_rank_zero_writes(runs):
    ddp = runs["ddp"]["dir"]
    assert len(list((ddp / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == ["last.ckpt"]
    assert runs["ddp"]["stdout"].count("TensorBoard logs:") == 1
    assert scalars(ddp, "eval/gsm8k_accuracy")  # 3 problems split over 2 ranks, gathered


def test_probes_log_under_ddp(runs):
    if runs["loss"] != "grpo":
        pytest.skip("probes run with the grpo pair")
    ddp = runs["ddp"]["dir"]
    assert len(scalars(ddp, "probe/gns/gns_G2_big")) == ROUNDS
    assert len(scalars(ddp, "probe/gns/gns_tr_sigma")) == ROUNDS  # 2 micro-batches x 2 ranks: estimable
    assert len(scalars(ddp, "probe/gns/gns_G2")) == ROUNDS  # (B_simple only once its EMA of |G|^2 is > 0)
    assert len(scalars(ddp, "probe/entropy/seq_mean")) == ROUNDS


def test_ddp_resume_continues_exactly(tmp_path):
    """2 rounds, then resumed to 3 (each rank restores its own RNG stream and generates round 2), equals 3 rounds
    straight; both with 2 processes and the default per-rank sampling streams (no seed_per_prefix)."""
    common = ["generator.seed_per_prefix=false", "loss=grpo"]
    straight = run(tmp_path / "straight", 2, *common, "trainer.max_epochs=3")
    split = run(tmp_path / "split", 2, *common, "trainer.max_epochs=2")
    resumed = run(tmp_path / "resumed", 2, *common, "trainer.max_epochs=3", f"ckpt_path={split['dir']}")
    assert "resuming from" in resumed["stdout"]
    a = torch.load(straight["dir"] / "rank1.pt")
    b = torch.load(resumed["dir"] / "rank1.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_killed_training_process_stops_the_run_in_bounded_time_and_it_resumes_exactly(tmp_path):
    """Rank 1 SIGKILLed as round 2 starts (after round 1's checkpoint): rank 0 stops within seconds with one error
    line and the resume command (gloo sees the closed connection at its next collective), and the resumed run
    equals 3 rounds straight, bitwise."""
    common = ["generator.seed_per_prefix=false", "loss=grpo", "trainer.max_epochs=3"]
    straight = run(tmp_path / "straight", 2, *common)
    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    kill = ["+callbacks.kill._target_=tests.helpers.KillRank", "+callbacks.kill.rank=1", "+callbacks.kill.at_round=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    start = time.monotonic()
    result = cli_run(*run_overrides(killed_dir, 2, *common, *kill), cwd=ROOT, env=env, timeout=300)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "another training process is gone" in errors[0], result.stderr[-3000:]
    assert f"ckpt_path={killed_dir.resolve() / 'checkpoints' / 'last.ckpt'}" in result.stderr
    print(f"rank 1 killed: rank 0 stopped {elapsed:.0f} s after the run started")
    resumed = run(tmp_path / "resumed", 2, *common, f"ckpt_path={killed_dir}")
    a, b = torch.load(straight["dir"] / "rank1.pt"), torch.load(resumed["dir"] / "rank1.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    """Overlapped rounds (docs/overlap.md), 3 rounds: one process, two processes, and two processes run for 2
    rounds then extended to 3 from the checkpoint (which keeps the engine copy's weights for the next round).
    Dynamic sampling is on (the default), so every round's stop decision is a collective from each rank's
    sampler thread, through the sampler's own gloo group, while the trainer all-reduces gradients."""
    root = tmp_path_factory.mktemp("overlap")
    common = ["rollout.max_staleness=1", "trainer.max_epochs=3"]
    runs = {"single": run(root / "single", 1, *common), "ddp": run(root / "ddp", 2, *common)}
    split = run(root / "split", 2, *common, "trainer.max_epochs=2")
    runs["resumed"] = run(root / "resumed", 2, *common, f"ckpt_path={split['dir']}")
    return runs


def test_overlapped_ddp_ranks_equal_one_overlapped_process(overlapped):
    rank0, rank1 = (torch.load(overlapped["ddp"]["dir"] / f"rank{r}.pt") for r in (0, 1))
    reference = torch.load(overlapped["single"]["dir"] / "rank0.pt")
    assert rank0.keys() == rank1.keys() == reference.keys()
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    for name in reference:
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    assert scalars(overlapped["ddp"]["dir"], "rollout/staleness") == [0.0, 1.0, 1.0]
    assert scalars(overlapped["ddp"]["dir"], "train/reward_mean") == pytest.approx(
        scalars(overlapped["single"]["dir"], "train/reward_mean"), rel=1e-6
    )  # the same rollouts, sampled by two processes' threads


def test_overlapped_ddp_extended_run_continues_exactly(overlapped):
    assert "resuming from" in overlapped["resumed"]["stdout"]
    for rank in (0, 1):
        a = torch.load(overlapped["ddp"]["dir"] / f"rank{rank}.pt")
        b = torch.load(overlapped["resumed"]["dir"] / f"rank{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("advantage", ["tree", "group"])
def test_storpo_under_two_ranks_equals_one_process(tmp_path, advantage):
    """STORPO logs a third's continuation reward only where a tree branched in that third, so ranks report
    different metric names; the round's metrics merge them by name (algorithm/round_metrics.py), and the two
    ranks train exactly what one process trains on the same rollouts."""
    extra = [
        "variant=storpo",
        f"variant.advantage={advantage}",
        "generator.max_new_tokens=16",
        "data.prompts_per_round=2",  # with seed 0, one rank branches no continuation in the last third
        "variant.num_generations=8",  # G (STORPO's plainly sampled group: tests/conftest.py group_size_for_variant)
    ]
    single, ddp = run(tmp_path / "single", 1, *extra), run(tmp_path / "ddp", 2, *extra)
    rank0, rank1 = torch.load(ddp["dir"] / "rank0.pt"), torch.load(ddp["dir"] / "rank1.pt")
    reference = torch.load(single["dir"] / "rank0.pt")
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    for name in reference:
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    assert scalars(ddp["dir"], "train/reward_mean") == pytest.approx(
        scalars(single["dir"], "train/reward_mean"), rel=1e-6
    )
    thirds = [f"rollout/storpo_reward_{name}" for name in ("early", "middle", "late")]
    logged = [tag for tag in thirds if scalars_or_none(ddp["dir"], tag)]
    assert logged == [tag for tag in thirds if scalars_or_none(single["dir"], tag)]  # the same thirds branched


def scalars_or_none(run_dir: Path, tag: str) -> list[float] | None:
    events = EventAccumulator(str(next((run_dir / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    return [e.value for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else None
