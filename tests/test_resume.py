"""A run killed at any point and resumed ends bit for bit where an uninterrupted run ends.

The truth is the uninterrupted run itself: same seed, same config, its final `last.ckpt` (trainable weights,
AdamW moments, step counters). Runs go through the real CLI in subprocesses so SIGKILL and SIGINT are real.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.training.checkpointing import AtomicCheckpointIO
from tests.forked_cli import ForkedRun, cli_popen

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4
BASE = [
    "model=tiny",
    f"trainer.max_epochs={ROUNDS}",
    "generator.max_new_tokens=12",
    "trainer.enable_progress_bar=false",
    "~reward.terms.gsm8k",
    "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
    "optim.optimizer.lr=1e-3",
    "data.prompts_per_round=2",
    "eval.num_problems=2",
    "eval.every_n_rounds=2",
    "checkpoint.every_n_rounds=2",
]
STORPO_TWO_PASSES = ["variant=storpo", "data.num_iterations=2", "trainer.accumulate_grad_batches=1"]
DYNAMIC_SAMPLING = [
    "~reward.terms.vowels",
    "+reward.terms.even._target_=tests.helpers.VowelFractionOnEvenAnswers",
    "data.dynamic_sampling.enabled=true",
]
SETUPS = {
    "grpo": [],
    # STORPO branches, and two passes over each round: old log-probs are scored before the round's first update.
    "storpo_two_passes": STORPO_TWO_PASSES,
    # Dynamic sampling: odd-answer problems score 0 everywhere, so rounds draw extra batches and the prompt
    # stream position (checkpointed) moves by a varying amount per round.
    "dynamic_sampling": DYNAMIC_SAMPLING,
    # Overlapped rounds (docs/overlap.md): a kill can land while round k+1 is sampled beside round k's training;
    # the checkpoint holds round k+1 and theta_{k+1}, and round k+2 is sampled again from them.
    "overlap": ["rollout.max_staleness=1"],
    "overlap_storpo_two_passes": [*STORPO_TWO_PASSES, "rollout.max_staleness=4"],  # 2 micro-batches x 2 passes
    "overlap_dynamic_sampling": [*DYNAMIC_SAMPLING, "rollout.max_staleness=1"],
    # Self-play (docs/selfplay.md): the opponent pool (snapshots every round, ratings after every game) is
    # checkpointed with the round; rating-aware sampling makes every later opponent depend on it.
    "selfplay": [
        "experiment=selfplay_tictactoe",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",  # a spread a random model can move
        "variant.games_per_group=2",
        "variant.snapshot_every=1",
        "variant.opponent_sampling=match_quality",
        "variant.fixed_opponents=[random,base,perfect]",
        "generator.max_new_tokens=4",
        "eval.opponents=[random]",
    ],
}
# Self-play over the legal moves with a snapshot magnet refreshed every other round: the magnet's weights are
# checkpointed with the pool, and the moves are drawn from each match's own seeded generator.
SETUPS["selfplay_moves"] = [*SETUPS["selfplay"], "variant.move_policy=legal_moves", "variant.magnet=snapshot",
                            "variant.magnet_refresh=2", "loss.magnet_coef=0.2"]  # fmt: skip
SELFPLAY_BASE = ("~reward.terms.gsm8k", "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward")
NOT_BASE = {"selfplay": SELFPLAY_BASE, "selfplay_moves": SELFPLAY_BASE}
"""BASE overrides a setup replaces (self-play's reward has no gsm8k term to remove)."""


def args(setup: str) -> list[str]:
    return [*(a for a in BASE if a not in NOT_BASE.get(setup, ())), *SETUPS[setup]]


def start(run_dir: Path, *overrides: str, **env_vars: str) -> subprocess.Popen | ForkedRun:
    """`python -m grpo_lightning` in a process of its own (forked past its imports: tests/forked_cli.py)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
    env.pop("HYDRA_FULL_ERROR", None)
    return cli_popen(f"hydra.run.dir={run_dir}", *overrides, cwd=ROOT, env=env)


def finish(proc: subprocess.Popen | ForkedRun, expect: int = 0) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return out + err


def write_times(path: Path, proc: subprocess.Popen | ForkedRun, every: float):
    """Poll `path` every `every` seconds while `proc` runs: yield the time of each new write (its mtime changing),
    else None (a caller's deadline is checked there). A write just before the process ends is still seen."""
    seen = None
    while True:
        stamp = path.stat().st_mtime_ns if path.exists() else None
        if stamp != seen and stamp is not None:
            seen = stamp
            yield time.monotonic()
            continue
        if proc.poll() is not None:
            return
        yield None
        time.sleep(every)


def wait_for(path: Path, proc: subprocess.Popen | ForkedRun, writes: int = 1, timeout: float = 300) -> float:
    """Wait until `path` has been written `writes` times; returns the seconds between the last two writes."""
    deadline = time.monotonic() + timeout
    stamps = [time.monotonic()]
    for stamp in write_times(path, proc, every=0.02):
        if stamp is None:
            assert time.monotonic() < deadline, f"{path} was not written {writes} times"
            continue
        stamps.append(stamp)
        if len(stamps) > writes:
            return stamps[-1] - stamps[-2]
    raise AssertionError(f"the run ended before {path} was written {writes}x: {proc.communicate()[1][-3000:]}")


def final_state(run_dir: Path) -> dict:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return {
        "weights": ckpt["state_dict"],
        "adam": ckpt["optimizer_states"][0]["state"],
        "global_step": ckpt["global_step"],
        "epoch": ckpt["epoch"],
        "variant": ckpt["callbacks"]["RolloutLoop"]["ranks"][0].get("variant") or {},
    }


def assert_bitwise_equal(a: dict, b: dict, context: str = "") -> None:
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]), context
    assert a["weights"].keys() == b["weights"].keys() and a["weights"], context
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), f"{name} {context}"
    for index, state in a["adam"].items():
        for key, value in state.items():
            assert torch.equal(value, b["adam"][index][key]), f"adam {index} {key} {context}"
    pool_a, pool_b = a["variant"].get("pool"), b["variant"].get("pool")  # self-play: ratings and snapshots
    assert (pool_a is None) == (pool_b is None), context
    if pool_a is not None:
        assert pool_a["ratings"] == pool_b["ratings"], context
        assert list(pool_a["snapshots"]) == list(pool_b["snapshots"]), context
        for name, weights in pool_a["snapshots"].items():
            assert all(torch.equal(w, pool_b["snapshots"][name][k]) for k, w in weights.items()), f"{name} {context}"


def round_seconds(path: Path, proc: subprocess.Popen | ForkedRun) -> float:
    """Run `proc` to its end, watching `path`: the median time between its writes (one a round)."""
    stamps = [stamp for stamp in write_times(path, proc, every=0.01) if stamp is not None]
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return gaps[len(gaps) // 2] if gaps else 1.0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The truth: each setup run once without interruption, one after another, and how long a round took."""
    root = tmp_path_factory.mktemp("uninterrupted")
    states, rounds = {}, {}
    for name in SETUPS:
        proc = start(root / name, *args(name))
        rounds[name] = round_seconds(root / name / "checkpoints" / "last.ckpt", proc)
        finish(proc)
        states[name] = final_state(root / name)
    return {"states": states, "round_s": rounds, "root": root}


def test_a_finished_run_resumed_writes_its_policy_and_final_evaluation_again(tmp_path, uninterrupted):
    """A run stopped after its last checkpoint (here: its policy folder and final metrics removed, as a SIGKILL
    during the export leaves it), resumed: no round is left, and the policy and the final evaluation's metrics are
    written from the checkpoint, equal to the uninterrupted run's; resumed again, the same."""
    import json
    import shutil

    from safetensors.torch import load_file

    done = uninterrupted["root"] / "grpo"  # the uninterrupted run
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    shutil.rmtree(run_dir / "policy")
    (run_dir / "final_metrics.json").unlink()
    expected = json.loads((done / "final_metrics.json").read_text())
    for _ in range(2):
        out = finish(start(run_dir, *args("grpo"), f"ckpt_path={run_dir}"))
        assert "no round left" in out
        saved = load_file(run_dir / "policy" / "adapter_model.safetensors")
        original = load_file(done / "policy" / "adapter_model.safetensors")
        assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
        metrics = json.loads((run_dir / "final_metrics.json").read_text())
        evaluation = {k: v for k, v in expected.items() if k.startswith("eval/")}
        assert evaluation and {k: metrics[k] for k in evaluation} == evaluation


@pytest.mark.parametrize("setup", SETUPS)
def test_sigkill_at_a_random_point_then_resume_is_bitwise_equal(tmp_path, uninterrupted, setup):
    """SIGKILL inside round 1 or 2 (of 0..3), anywhere in it: after `writes` writes of last.ckpt, a random fraction
    of a round later (a round timed here when two writes were seen, else the uninterrupted run's). The process's
    own end (the interpreter's shutdown after its last round) is not a point inside a round."""
    seed = int(os.environ.get("RESUME_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    writes, fraction = rng.randint(1, ROUNDS - 2), rng.uniform(0.0, 0.9)  # kill inside round `writes`, anywhere
    run_dir = tmp_path / "run"
    proc = start(run_dir, *args(setup))
    round_s = wait_for(run_dir / "checkpoints" / "last.ckpt", proc, writes)
    time.sleep(fraction * (round_s if writes > 1 else uninterrupted["round_s"][setup]))
    assert proc.poll() is None, f"the run finished before the kill (RESUME_TEST_SEED={seed})"
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    err = finish(start(run_dir, *args(setup), "ckpt_path=last"))
    assert "resuming from" in err
    assert_bitwise_equal(uninterrupted["states"][setup], final_state(run_dir), context=f"RESUME_TEST_SEED={seed}")


@pytest.mark.parametrize("setup", ["grpo", "overlap"])
def test_sigint_finishes_the_round_saves_and_resumes_exactly(tmp_path, uninterrupted, setup):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *args(setup))
    wait_for(run_dir / "checkpoints" / "last.ckpt", proc)  # round 0 done; round 1 is being generated or trained
    proc.send_signal(signal.SIGINT)
    err = finish(proc, expect=128 + signal.SIGINT)
    assert "SIGINT received: finishing this round" in err
    assert "stopped after round" in err and "ckpt_path=" in err and "Traceback" not in err
    stopped = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert 1 <= stopped["epoch"] < ROUNDS - 1  # stopped early, at a round boundary
    finish(start(run_dir, *args(setup), "ckpt_path=last"))
    assert_bitwise_equal(uninterrupted["states"][setup], final_state(run_dir))


def test_a_sparse_last_checkpoint_still_saves_the_round_a_sigint_stops_at(tmp_path, uninterrupted):
    """`checkpoint.last_every_n_rounds=ROUNDS`: last.ckpt is due only after the last round, yet a stop in round 3
    writes that round, and the resumed run (the cadence back to its default) ends bit for bit where the
    uninterrupted run, which wrote every round, ends: the cadence changes when the file is written, nothing else."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *args("grpo"), f"checkpoint.last_every_n_rounds={ROUNDS}")
    wait_for(run_dir / "checkpoints" / "round001.ckpt", proc)  # rounds 1 and 2 done (checkpoint.every_n_rounds=2)
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()  # not due after rounds 1 and 2
    proc.send_signal(signal.SIGINT)  # lands in round 3, whose end is not due either
    finish(proc, expect=128 + signal.SIGINT)
    stopped = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert stopped["epoch"] == 2  # 0-based: round 3, where the run stopped
    finish(start(run_dir, *args("grpo"), "ckpt_path=last"))
    assert_bitwise_equal(uninterrupted["states"]["grpo"], final_state(run_dir))


def test_an_overlapped_run_extended_past_its_last_round_continues_as_the_longer_run(tmp_path, uninterrupted):
    """Its last checkpoint holds no next round, only the weights that round would be sampled from (the engine
    copy's snapshot): the extended run samples it from them, as the longer run did beside its training."""
    run_dir = tmp_path / "run"
    finish(start(run_dir, *BASE, *SETUPS["overlap"], f"trainer.max_epochs={ROUNDS - 2}"))
    finish(start(run_dir, *BASE, *SETUPS["overlap"], "ckpt_path=last"))
    assert_bitwise_equal(uninterrupted["states"]["overlap"], final_state(run_dir))


@pytest.mark.parametrize("setup", ["storpo_two_passes", "overlap_dynamic_sampling", "selfplay"])
def test_a_run_ends_bitwise_equal_under_another_hash_seed(tmp_path, uninterrupted, setup):
    """The runs above are forked from one server and share its `str` hash seed (tests/forked_cli.py): a real
    process with a fixed other seed ends bit for bit where the uninterrupted run ends, so no result hangs on the
    order of a set of strings (STORPO's branches, dynamic sampling's redraws, the self-play pool's names)."""
    seed = "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"
    proc = start(tmp_path / "run", *args(setup), PYTHONHASHSEED=seed)
    assert not isinstance(proc, ForkedRun)  # an interpreter-start-up setting: a real process
    finish(proc)
    assert_bitwise_equal(
        uninterrupted["states"][setup], final_state(tmp_path / "run"), context=f"PYTHONHASHSEED={seed}"
    )


def test_checkpoint_write_killed_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"round": 1, "w": torch.arange(4.0)}, path)

    def dies_midway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial zip")
        raise KeyboardInterrupt  # as if the process died here

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"round": 2, "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    saved = torch.load(path, weights_only=True)
    assert saved["round"] == 1 and torch.equal(saved["w"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind
