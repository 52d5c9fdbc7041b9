"""The self-play live view: the rendered numbers against hand-computed ones, and the callback's life cycle."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import RichProgressBar
from rich.console import Console
from rich.live import Live

from grpo_lightning.games.progress import PoolEntry, ReportsProgress, SelfPlayProgress
from grpo_lightning.training.live_view import SelfPlayLiveView, live_view, render_text

POOL = (
    PoolEntry("base", mu=26.0, sigma=2.0, games=4),
    PoolEntry("learner", mu=28.5, sigma=1.5, games=0),
    PoolEntry("random", mu=18.0, sigma=3.0, games=4),
    PoolEntry("round002", mu=27.0, sigma=1.0, games=0),
)
EVAL = {
    "eval/win_rate_vs_random": 0.75,
    "eval/win_rate_vs_random_ci95_low": 0.53,
    "eval/win_rate_vs_random_ci95_high": 0.888,
    "eval/draw_rate_vs_random": 0.125,
    "eval/loss_rate_vs_random": 0.125,
    "eval/win_rate_vs_base": 0.5,  # no interval, no draw or loss rate
    "eval/illegal_move_rate": 0.05,
}


def progress(**changes) -> SelfPlayProgress:
    values = dict(
        round_index=3,
        game_id="tictactoe",
        games_total=10,
        games_finished=8,
        wins=3,
        draws=1,
        losses=4,
        learner_turns=10,
        illegal_moves=2,
        pool=POOL,
        last_eval=EVAL,
    )
    return SelfPlayProgress(**(values | changes))


class Reporting:
    """A variant that reports its rounds."""

    def __init__(self) -> None:
        self.progress_listeners: list = []


def trainer(bar=None, rank_zero: bool = True):
    return SimpleNamespace(is_global_zero=rank_zero, progress_bar_callback=bar)


def rows(text: str, name: str) -> list[list[str]]:
    """The table rows of `name` in the rendered text, as their cells (inside the panel's borders)."""
    return [line.split()[2:-1] for line in text.splitlines() if line.split()[1:2] == [name]]


# ---- rendering ---------------------------------------------------------------------------------------------------
def test_the_round_and_the_learners_results():
    text = render_text(progress())
    assert "round 3" in text and "tictactoe" in text
    assert "2 in flight, 8 finished, 10 total" in text  # 10 - 8 in flight
    # rates over the 8 finished games: 3/8, 1/8, 4/8
    assert "3 won (0.375), 1 drawn (0.125), 4 lost (0.500)" in text
    assert "2 of 10 turns (0.200)" in text  # 2 illegal of 10 learner turns


def test_no_finished_game_or_turn_gives_no_rate():
    text = render_text(progress(games_finished=0, wins=0, draws=0, losses=0, learner_turns=0, illegal_moves=0))
    assert "0 won (-), 0 drawn (-), 0 lost (-)" in text
    assert "0 of 0 turns (-)" in text


def test_the_pool_is_sorted_by_mu_with_the_conservative_rating():
    text = render_text(progress())
    pool = text.split("latest evaluation")[0]
    names = [line.split()[1] for line in pool.splitlines() if line.split()[1:2] in (["learner"], ["round002"],
             ["base"], ["random"])]  # fmt: skip
    assert names == ["learner", "round002", "base", "random"]  # mu 28.5 > 27.0 > 26.0 > 18.0
    # mu, sigma, mu - 3 sigma (28.5 - 4.5, 27 - 3, 26 - 6, 18 - 9), games
    assert rows(pool, "learner") == [["28.50", "1.50", "24.00", "0"]]
    assert rows(pool, "round002") == [["27.00", "1.00", "24.00", "0"]]
    assert rows(pool, "base") == [["26.00", "2.00", "20.00", "4"]]
    assert rows(pool, "random") == [["18.00", "3.00", "9.00", "4"]]


def test_the_latest_evaluation_with_its_interval():
    text = render_text(progress())
    assert "latest evaluation" in text
    evaluation = text.split("latest evaluation")[1]
    assert rows(evaluation, "random") == [["0.750", "[0.530,", "0.888]", "0.125", "0.125"]]
    assert rows(evaluation, "base") == [["0.500", "-", "-", "-"]]  # no interval, draw or loss rate given
    assert "illegal move rate 0.050" in text


def test_no_evaluation_section_before_an_evaluation():
    text = render_text(progress(last_eval={}))
    assert "latest evaluation" not in text and "illegal move rate" not in text and "0.750" not in text


def test_an_evaluation_without_its_optional_keys():
    text = render_text(progress(last_eval={"eval/win_rate_vs_perfect": 0.0}))
    assert rows(text, "perfect") == [["0.000", "-", "-", "-"]]
    assert "illegal move rate" not in text


# ---- the callback ------------------------------------------------------------------------------------------------
def test_the_factory_builds_a_view_only_for_a_variant_that_reports():
    assert isinstance(Reporting(), ReportsProgress)
    assert not isinstance(SimpleNamespace(), ReportsProgress)
    assert live_view(SimpleNamespace()) is None
    assert live_view(Reporting(), enabled=False) is None
    view = live_view(Reporting(), refresh_per_second=2)
    assert isinstance(view, SelfPlayLiveView) and view.settings.refresh_per_second == 2


def test_a_bad_setting_names_its_key():
    with pytest.raises(ValueError, match=r"callbacks\.live_view\.refresh_per_second must be > 0 \(got 0\)"):
        live_view(Reporting(), refresh_per_second=0)
    with pytest.raises(ValueError, match=r"callbacks\.live_view\.enabled must be true or false"):
        live_view(Reporting(), enabled="yes")


def test_the_config_check_names_the_key(tmp_path):
    from grpo_lightning.app.validation import check_rules
    from tests.conftest import make_cfg

    assert check_rules(make_cfg(tmp_path, ["callbacks.live_view.refresh_per_second=0"])) == [
        "callbacks.live_view.refresh_per_second must be > 0 (got 0)"
    ]


def test_update_keeps_the_progress_and_prints_nothing_off_a_terminal():
    variant, out = Reporting(), io.StringIO()
    view = SelfPlayLiveView(variant, console=Console(file=out, force_terminal=False))
    view.setup(trainer(), None, "fit")
    assert variant.progress_listeners == [view.update]
    view.setup(trainer(), None, "fit")  # registers once
    assert len(variant.progress_listeners) == 1
    first = progress()
    variant.progress_listeners[0](first)
    assert view.latest is first and view.live is None
    view.stop()
    view.stop()  # twice is fine
    view.teardown(trainer(), None, "fit")
    assert variant.progress_listeners == [] and out.getvalue() == ""


def test_only_rank_zero_listens():
    variant = Reporting()
    SelfPlayLiveView(variant).setup(trainer(rank_zero=False), None, "fit")
    assert variant.progress_listeners == []


def test_on_a_terminal_it_draws_and_stops_once():
    variant, out = Reporting(), io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view = SelfPlayLiveView(variant, console=console)
    view.setup(trainer(), None, "fit")
    view.update(progress())
    assert view.live is not None and view.live.is_started
    assert "3 won (0.375)" in out.getvalue()
    view.on_fit_end(trainer(), None)
    view.on_exception(trainer(), None, RuntimeError())
    view.teardown(trainer(), None, "fit")
    assert view.live is None and console._live_stack == []
    drawn = out.getvalue()
    view.update(progress(wins=4))  # after the end: kept, not drawn
    assert view.latest.wins == 4 and out.getvalue() == drawn


def test_it_pauses_while_a_rich_bar_takes_the_console_over_and_then_draws_beside_it():
    variant, out = Reporting(), io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view, bar = SelfPlayLiveView(variant, console=console), RichProgressBar()
    view.setup(trainer(bar), None, "fit")
    view.update(progress(round_index=0))  # round 0, played in the rollout loop's on_fit_start
    view.on_fit_start(trainer(bar), None)
    assert view.live is None and console._live_stack == []
    view.update(progress(round_index=1))  # before the bar has started: kept, not drawn
    assert view.live is None
    other = Live("the bar", console=console, auto_refresh=False)  # what the bar starts at on_train_start
    other.start()
    view.on_train_start(trainer(bar), None)
    view.update(progress(round_index=1, games_finished=10))
    assert view.live is not None and console._live_stack == [other, view.live]  # drawn with the bar's display
    assert "round 1" in out.getvalue()
    view.on_fit_end(trainer(bar), None)
    assert console._live_stack == [other]
    other.stop()


def test_the_evaluation_shows_each_seat_under_its_opponent():
    metrics = {
        "eval/win_rate_vs_random": 0.75, "eval/draw_rate_vs_random": 0.125, "eval/loss_rate_vs_random": 0.125,
        "eval/win_rate_vs_random_first": 0.875, "eval/win_rate_vs_random_first_ci95_low": 0.529,
        "eval/win_rate_vs_random_first_ci95_high": 0.978, "eval/draw_rate_vs_random_first": 0.125,
        "eval/loss_rate_vs_random_first": 0.0,
        "eval/win_rate_vs_random_second": 0.625, "eval/draw_rate_vs_random_second": 0.125,
        "eval/loss_rate_vs_random_second": 0.25,
    }  # fmt: skip
    lines = render_text(progress(last_eval=metrics)).splitlines()
    first = next(line for line in lines if "random, learner moving first" in line)
    second = next(line for line in lines if "random, learner moving second" in line)
    assert first.split()[-6:-1] == ["0.875", "[0.529,", "0.978]", "0.125", "0.000"]
    assert "0.625" in second and "0.250" in second
    assert lines.index(first) < lines.index(second)
