"""variant=selfplay end to end on the tiny model: the recipe's config trains, evaluates by playing, logs the game and
pool metrics, and the run summary shows the win rates. What the numbers mean is checked in tests/unit/
test_selfplay.py; here, that the run reports them consistently with the rollouts it trained on.

Under two processes (gloo, CPU): two ranks playing real rounds on a scripted engine hold, after every round, the
ratings of openskill applied by hand to both ranks' games (rank 0's, then rank 1's, each in the order played) and
count both ranks' games; a two-process CLI run keeps one pool on both ranks, logs the pool's own values and the
total of games, and resumes to the pool of the run it was split from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_lightning.app.train import build_run, train
from grpo_lightning.distributed import shard
from grpo_lightning.games.opponent_pool import LEARNER, OpponentPool, rating_model
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.variants.selfplay import SelfPlay
from tests.conftest import make_cfg
from tests.forked_cli import cli_run
from tests.test_ddp import scalars
from tests.unit.test_selfplay import REWARD, MoveEngine, lowest_legal, prompts, source

ROOT = Path(__file__).resolve().parents[1]

SELFPLAY = [
    "experiment=selfplay_tictactoe",
    "model=tiny",
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "generator.max_new_tokens=4",
    "variant.games_per_group=2",
    "data.prompts_per_round=2",
    "eval.num_problems=2",
    "eval.every_n_rounds=1",
]


@pytest.mark.slow
def test_selfplay_trains_and_reports_games(tmp_path):
    # the recipe's scripted opponents and the base model, whose moves the evaluation plays with the adapter off
    run = build_run(make_cfg(tmp_path / "run", [*SELFPLAY, "eval.opponents=[random,tactic,base]"]))
    rounds = []
    original = run.rollout_loop.finish

    def keep(trainer, pl_module, sampled, round_index, staleness):
        rounds.append(sampled)
        original(trainer, pl_module, sampled, round_index, staleness)

    run.rollout_loop.finish = keep
    metrics = run.fit()
    last = rounds[-1]
    # the round's illegal-move rate is the share of its trained turns whose legal term was -1
    illegal = sum(r.reward_terms["legal"] == -1.0 for r in last.rollouts) / len(last.rollouts)
    assert last.variant_metrics["game/illegal_move_rate"] == pytest.approx(illegal)
    assert last.variant_metrics["game/games"] == 4.0  # 2 seeds x 2 games
    for key in ("game/win_rate", "pool/size", "pool/mu_learner", "pool/mu_random", "pool/mu_base"):
        assert key in metrics, key
    assert metrics["eval/games"] == 12.0  # 2 seeds x 2 seats x 3 opponents (random, tactic, base)
    for key in ("eval/win_rate_vs_random", "eval/win_rate_vs_base_ci95_high", "eval/illegal_move_rate",
                "eval/loss_rate_vs_tactic_second", "summary/eval_win_rate_vs_random_end"):  # fmt: skip
        assert key in metrics, key
    assert {r.group_id for r in last.rollouts} == {0, 1}


@pytest.mark.slow
def test_selfplay_dry_run_loads_no_model(tmp_path, capsys):
    assert train(make_cfg(tmp_path / "dry", [*SELFPLAY, "dry_run=true"])) == {}
    out = capsys.readouterr().out
    assert "tictactoe games (train: seeds 0..999, replies start with '[')" in out
    assert "selfplay" in out


# ---- two processes: one pool ---------------------------------------------------------------------------------------
FIXED_RESULTS = {
    0: [("random", 1.0), ("base", -1.0), ("random", 0.0)],
    1: [("base", 1.0), (LEARNER, 1.0), ("random", -1.0), ("base", 0.0)],
}
"""Each rank's own games (opponent, learner's score), for the pool's gathering and applying alone."""
SEEDS_PER_ROUND = 4
ROUNDS = 2
POOL = {"games_per_group": 3, "fixed_opponents": ["random", "base", "perfect"], "opponent_sampling": "match_quality",
        "snapshot_every": 1}  # fmt: skip


def round_seeds(round_index: int) -> list[int]:
    return list(range(10 * round_index, 10 * round_index + SEEDS_PER_ROUND))


def _rank(rank: int, world_size: int, store: str, out: str, tokenizer) -> None:
    """One rank of a real two-process gloo group: the pool's `record_all_ranks` on FIXED_RESULTS, then ROUNDS
    self-play rounds of this rank's block of seeds on the scripted engine. Writes what it played (its own games,
    in the order played), its metrics and its pool after each round to `<out>/rank<r>.pt`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        pool = OpponentPool("match_quality", ("random", "base"), max_snapshots=2, lagged_window=1)
        applied = pool.record_all_ranks(FIXED_RESULTS[rank])
        report = {"fixed": (applied, pool.state_dict()["ratings"]), "rounds": []}
        v = SelfPlay(**POOL)
        v.bind_data(source(), tokenizer, 512)
        played = []
        play = v.play

        def recording_play(matches, generator, decode):
            play(matches, generator, decode)
            played.extend(matches)  # the round's games, then its extra games: the order they are recorded in

        v.play = recording_play
        reward = build_reward(REWARD)
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        for r in range(ROUNDS):
            played.clear()
            v.begin_round(r)
            seeds = shard(round_seeds(r), rank, world_size)
            v.generate_rollouts(MoveEngine(tokenizer, lowest_legal), prompts(seeds), reward, decode)
            report["rounds"].append({
                "results": [(m.opponent.name, m.learner_score) for m in played],
                "metrics": dict(v.metrics),
                "pool": v.pool.state_dict(),
            })  # fmt: skip
        torch.save(report, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def by_hand(results: list[tuple[str, float]], ratings: dict | None = None, model=None) -> dict:
    """openskill's Thurstone-Mosteller updates applied in a loop, one game after another (mirror games: none)."""
    model = model or rating_model()
    ratings = dict(ratings or {})
    for opponent, score in results:
        if opponent == LEARNER:
            continue
        ranks = [0, 1] if score > 0 else [1, 0] if score < 0 else [0, 0]
        [[ratings[LEARNER]], [ratings[opponent]]] = model.rate([[ratings[LEARNER]], [ratings[opponent]]], ranks=ranks)
    return ratings


def mu_sigma(ratings: dict) -> dict[str, tuple[float, float]]:
    return {name: (float(r.mu), float(r.sigma)) for name, r in ratings.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_rank, args=(2, str(out / "store"), str(out), tokenizer), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
def test_ranks_apply_every_ranks_results_in_rank_order(two_ranks):
    """The pool's gathering and applying alone: both ranks apply rank 0's results, then rank 1's, and end with the
    ratings of openskill applied to that list in a loop, as one process recording the same list does."""
    ordered = FIXED_RESULTS[0] + FIXED_RESULTS[1]
    model = rating_model()
    truth = mu_sigma(by_hand(ordered, {n: model.rating() for n in (LEARNER, "random", "base")}, model))
    one = OpponentPool("match_quality", ("random", "base"), max_snapshots=2, lagged_window=1)
    assert one.record_all_ranks(ordered) == ordered  # one process: its own results, the same path
    for rank in (0, 1):
        applied, ratings = two_ranks[rank]["fixed"]
        assert applied == ordered
        assert {n: (mu, sigma) for n, (mu, sigma, _) in ratings.items()} == truth
        assert ratings == one.state_dict()["ratings"]
    assert truth[LEARNER] != (model.rating().mu, model.rating().sigma)  # the games moved it


@pytest.mark.slow
def test_ranks_playing_rounds_hold_one_pool_and_count_every_game(two_ranks, tokenizer):
    """Real rounds, rating-aware sampling: after each round both ranks hold the pool of openskill applied by hand
    to rank 0's games then rank 1's (a snapshot entering with the learner's rating, as the pool's rule says), report
    the same metrics, `game/games` is both ranks' games and the rates are over them; each rank dealt its opponents
    from that shared pool (one process, given the pool after round 0, deals the same for each rank's seeds)."""
    model = rating_model()
    ratings = {n: model.rating() for n in (LEARNER, "random", "base", "perfect")}
    for r in range(ROUNDS):
        ratings[f"round{r:03d}"] = model.rating(mu=ratings[LEARNER].mu, sigma=ratings[LEARNER].sigma)
        games = [g for rank in (0, 1) for g in two_ranks[rank]["rounds"][r]["results"]]
        ratings = by_hand(games, ratings, model)
        truth = mu_sigma(ratings)
        reports = [two_ranks[rank]["rounds"][r] for rank in (0, 1)]
        for report in reports:
            assert {n: (mu, sigma) for n, (mu, sigma, _) in report["pool"]["ratings"].items()} == truth
            metrics = report["metrics"]
            assert metrics["game/games"] == len(games) >= SEEDS_PER_ROUND * POOL["games_per_group"]
            assert metrics["game/win_rate"] == sum(s > 0 for _, s in games) / len(games)
            assert metrics["game/loss_rate"] == sum(s < 0 for _, s in games) / len(games)
            assert metrics["pool/mu_learner"] == truth[LEARNER][0]
            assert metrics["pool/mu_perfect"] == truth["perfect"][0]
        assert reports[0]["metrics"] == reports[1]["metrics"]
        assert reports[0]["pool"]["ratings"] == reports[1]["pool"]["ratings"]
    assert len({s for r in range(ROUNDS) for rank in (0, 1) for _, s in two_ranks[rank]["rounds"][r]["results"]}) > 1
    one = SelfPlay(**POOL)
    one.bind_data(source(), tokenizer, 512)
    one.pool.load_state_dict(two_ranks[0]["rounds"][0]["pool"])
    engine = MoveEngine(tokenizer, lowest_legal)
    one.begin_round(1)
    one.pool.add_snapshot("round001", engine.adapter_weights())
    for rank in (0, 1):
        dealt = one.deal(engine, prompts(shard(round_seeds(1), rank, 2)))
        played = two_ranks[rank]["rounds"][1]["results"]
        assert [m.opponent.name for m in dealt] == [name for name, _ in played[: len(dealt)]]


DDP_SELFPLAY = [
    *(o for o in SELFPLAY if not o.startswith(("data.prompts_per_round=", "trainer.max_epochs="))),
    "data.prompts_per_round=4",  # 2 seeds a rank
    "eval.opponents=[random]",
    "variant.opponent_sampling=match_quality",
    "variant.snapshot_every=1",
    "variant.fixed_opponents=[random,base,perfect]",
    "trainer=ddp",
    "trainer.devices=2",
    "trainer.accelerator=cpu",
]


def ddp_run(run_dir: Path, *extra: str) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    result = cli_run(f"hydra.run.dir={run_dir}", *DDP_SELFPLAY, *extra, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def pools(run_dir: Path) -> list[dict]:
    """Each rank's pool as its checkpoint holds it (rank 0 writes every rank's part)."""
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return [part["variant"]["pool"] for part in ckpt["callbacks"]["RolloutLoop"]["ranks"]]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Two processes: 3 rounds straight, and 2 rounds extended to 3 from their checkpoint."""
    root = tmp_path_factory.mktemp("selfplay_ddp")
    straight = ddp_run(root / "straight", "trainer.max_epochs=3")
    split = ddp_run(root / "split", "trainer.max_epochs=2")
    resumed = ddp_run(root / "resumed", "trainer.max_epochs=3", f"ckpt_path={split}")
    return {"straight": straight, "split": split, "resumed": resumed}


@pytest.mark.slow
def test_ddp_run_keeps_one_pool_and_logs_its_values_and_every_game(ddp_runs):
    for run in ddp_runs.values():
        rank0, rank1 = pools(run)
        assert rank0["ratings"] == rank1["ratings"]
        assert rank0["snapshots"].keys() == rank1["snapshots"].keys()
    split = ddp_runs["split"]
    extra = scalars(split, "game/extra_games")
    assert scalars(split, "game/games") == [4 * 2 + e for e in extra]  # 4 seeds x 2 games, both ranks'
    ratings = pools(split)[0]["ratings"]  # the pool after the last round's games: what that round logged
    for name, (mu, _, _) in ratings.items():
        assert scalars(split, f"pool/mu_{name}")[-1] == pytest.approx(mu, rel=1e-6), name
    assert scalars(split, "pool/learner_sigma")[-1] == pytest.approx(ratings[LEARNER][1], rel=1e-6)


@pytest.mark.slow
def test_ddp_run_resumed_holds_the_pool_of_the_straight_run(ddp_runs):
    straight, resumed = pools(ddp_runs["straight"]), pools(ddp_runs["resumed"])
    for a, b in zip(straight, resumed, strict=True):
        assert a["ratings"] == b["ratings"]
        assert a["snapshots"].keys() == b["snapshots"].keys()
        for name in a["snapshots"]:
            assert all(torch.equal(a["snapshots"][name][k], b["snapshots"][name][k]) for k in a["snapshots"][name])
