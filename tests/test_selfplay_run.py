"""variant=selfplay end to end on the tiny model: the recipe's config trains, evaluates by playing, logs the game and
pool metrics, and the run summary shows the win rates. What the numbers mean is checked in tests/unit/
test_selfplay.py; here, that the run reports them consistently with the rollouts it trained on."""

from __future__ import annotations

import pytest

from grpo_lightning.app.train import build_run, train
from tests.conftest import make_cfg

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
    run = build_run(make_cfg(tmp_path / "run", SELFPLAY))
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
    assert metrics["eval/games"] == 8.0  # 2 seeds x 2 seats x 2 opponents
    for key in ("eval/win_rate_vs_random", "eval/win_rate_vs_base_ci95_high", "eval/illegal_move_rate",
                "summary/eval_win_rate_vs_random_end"):  # fmt: skip
        assert key in metrics, key
    assert {r.group_id for r in last.rollouts} == {0, 1}


@pytest.mark.slow
def test_selfplay_dry_run_loads_no_model(tmp_path, capsys):
    assert train(make_cfg(tmp_path / "dry", [*SELFPLAY, "dry_run=true"])) == {}
    out = capsys.readouterr().out
    assert "tictactoe games (train: seeds 0..999, replies start with '[')" in out
    assert "selfplay" in out
