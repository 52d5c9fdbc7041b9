"""A live terminal view of a self-play round: games in flight, the learner's results, the rated pool, the latest
evaluation.

The view works with any variant that reports its rounds (`ReportsProgress`, games/progress.py): a list attribute
`progress_listeners` of callables that the variant calls with a `SelfPlayProgress` while a round plays.
`live_view` (the `callbacks.live_view` entry) builds nothing for any other variant, so the entry costs nothing
there.

Where it draws: rich's global console, the one Lightning's Rich progress bar draws on, and only when that console
is a terminal; in a log file or CI the view keeps the latest progress and prints nothing. Rich (>= 14.1) draws
two live displays of one console as one, so while the bar is on screen the view shows below it. The bar takes
the console over when training starts (it reconfigures the global console), so the view draws the round played
before training (round 0, in the rollout loop's `on_fit_start`) on its own, leaves that frame on screen at
`on_fit_start`, and draws again beside the bar from the next report after `on_train_start`. With an older rich,
which allows one live display per console, the view stays off while the bar is on (one log line says so).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from dataclasses import dataclass

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from rich import box, get_console
from rich.console import Console, Group, RenderableType
from rich.errors import LiveError
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from grpo_lightning.games.progress import ReportsProgress, SelfPlayProgress
from grpo_lightning.schema import Configured, boolean, check_settings, configures, number, setting
from grpo_lightning.training.game_evaluation import SEAT_NAMES

log = logging.getLogger(__name__)

WIN_RATE = "eval/win_rate_vs_"
"""Prefix of the evaluation's win rate against one opponent: `eval/win_rate_vs_<name>`, with its Wilson
interval `..._ci95_low` / `..._ci95_high`, beside `eval/draw_rate_vs_<name>` and `eval/loss_rate_vs_<name>`."""
INTERVAL = ("_ci95_low", "_ci95_high")
SEAT_LABELS = {seat: f"moving {seat}" for seat in SEAT_NAMES}
"""The per-seat rows of an evaluation (`eval/win_rate_vs_<name>_first`), by the evaluator's seat names."""
ILLEGAL_RATE = "eval/illegal_move_rate"


# ---- rendering ---------------------------------------------------------------------------------------------------
def rate(count: int, total: int) -> str:
    """`count / total` with three decimals; `-` when there is nothing to divide by."""
    return f"{count / total:.3f}" if total else "-"


def eval_opponents(metrics: dict[str, float]) -> list[str]:
    """The opponents an evaluation names (`eval/win_rate_vs_<name>`), in the order of its keys."""
    return [key.removeprefix(WIN_RATE) for key in metrics if key.startswith(WIN_RATE) and not key.endswith(INTERVAL)]


def pool_table(progress: SelfPlayProgress) -> Table:
    """The rated pool, best mu first: the conservative rating mu - 3 sigma is what a ranking by skill trusts."""
    table = Table(title="pool", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("opponent")
    for name in ("mu", "sigma", "mu - 3 sigma", "games"):
        table.add_column(name, justify="right")
    for entry in sorted(progress.pool, key=lambda e: e.mu, reverse=True):
        table.add_row(
            entry.name,
            f"{entry.mu:.2f}",
            f"{entry.sigma:.2f}",
            f"{entry.mu - 3 * entry.sigma:.2f}",
            str(entry.games),
            style="bold" if entry.name == "learner" else None,
        )
    return table


def eval_table(metrics: dict[str, float]) -> Table:
    """The latest evaluation: per opponent, then per seat, the learner's win rate with its 95% interval, draw and
    loss rates."""
    table = Table(title="latest evaluation", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("opponent")
    for name in ("win", "95% interval", "draw", "loss"):
        table.add_column(name, justify="right")

    def value(key: str) -> str:
        return f"{metrics[key]:.3f}" if key in metrics else "-"

    for name in eval_opponents(metrics):
        low, high = (f"{WIN_RATE}{name}{end}" for end in INTERVAL)
        interval = f"[{metrics[low]:.3f}, {metrics[high]:.3f}]" if low in metrics and high in metrics else "-"
        label = name
        for seat in SEAT_LABELS:
            if name.endswith(f"_{seat}"):  # a per-seat row of the evaluation: `random_first`
                label = f"  {name.removesuffix(f'_{seat}')}, learner {SEAT_LABELS[seat]}"
        table.add_row(
            label,
            value(f"{WIN_RATE}{name}"),
            interval,
            value(f"eval/draw_rate_vs_{name}"),
            value(f"eval/loss_rate_vs_{name}"),
        )
    if ILLEGAL_RATE in metrics:
        table.caption = f"illegal move rate {metrics[ILLEGAL_RATE]:.3f}"
        table.caption_justify = "left"
    return table


def render(progress: SelfPlayProgress) -> RenderableType:
    """One frame of the view: the round's games, the learner's results this round (rates over the finished games),
    its illegal moves (over its turns), the pool by mu, and the latest evaluation when there is one."""
    p = progress
    finished = p.games_finished
    lines = [
        Text(f"games: {p.games_in_flight} in flight, {finished} finished, {p.games_total} total"),
        Text(
            f"learner: {p.wins} won ({rate(p.wins, finished)}), {p.draws} drawn ({rate(p.draws, finished)}), "
            f"{p.losses} lost ({rate(p.losses, finished)})"
        ),
        Text(f"illegal moves: {p.illegal_moves} of {p.learner_turns} turns ({rate(p.illegal_moves, p.learner_turns)})"),
    ]
    parts: list[RenderableType] = [*lines]
    if p.pool:
        parts.append(pool_table(p))
    if p.last_eval:
        parts.append(eval_table(p.last_eval))
    return Panel(Group(*parts), title=f"self-play round {p.round_index}, game {p.game_id}", title_align="left")


def render_text(progress: SelfPlayProgress, width: int = 100) -> str:
    """`render` as plain text (no colour, no terminal codes), for tests and logs."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(render(progress))
    return console.file.getvalue()


def waiting() -> RenderableType:
    return Text("self-play: waiting for the round's first report")


# ---- the callback ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveViewSettings:
    """`callbacks.live_view`: the self-play round's live view in the terminal."""

    enabled: bool = setting(True, boolean)
    refresh_per_second: float = setting(4.0, number(above=0))

    def __post_init__(self) -> None:
        check_settings(self, "callbacks.live_view")


class SelfPlayLiveView(Configured, L.Callback):
    """Draws the round a variant reports (`ReportsProgress`) in the terminal while it plays (rank 0 only).

    `setup` registers `update` with the variant's `progress_listeners`; the live display starts at the first
    report, on a console that is a terminal, and stops at `on_fit_end`, `on_exception` and `teardown` (stopping
    twice does nothing). `latest` holds the last report, drawn or not. A variant that does not
    report (no `progress_listeners` list) leaves the view off.
    """

    settings_types = (LiveViewSettings,)

    def __init__(self, variant, *, evaluator=None, console: Console | None = None, **keys) -> None:
        """`variant` and `evaluator` are the run's (passed by the run, conf/callbacks/default.yaml; the latest
        evaluation's metrics are the evaluator's `final_metrics`); `console`: where to draw (None: rich's global
        console, shared with Lightning's Rich progress bar); `keys`: `callbacks.live_view`'s (`LiveViewSettings`)."""
        (self.settings,) = self.settings_from(keys)
        self.variant = variant
        self.evaluator = evaluator
        self.console = console
        self.latest: SelfPlayProgress | None = None
        self.live: Live | None = None
        self.registered = False
        self.may_draw = False  # off before setup, between on_fit_start and on_train_start (the bar's), after the end
        self.unsupported = False  # an older rich refused a second live display: stay off
        self.last_refresh = 0.0
        self.lock = threading.RLock()  # reports may come from the sampler's thread

    @property
    def active(self) -> bool:
        """Enabled, and the variant reports its rounds."""
        return self.settings.enabled and isinstance(self.variant, ReportsProgress)

    def target(self) -> Console:
        return self.console if self.console is not None else get_console()

    # ---- reports -------------------------------------------------------------------------------------------
    def update(self, progress: SelfPlayProgress) -> None:
        """A variant's report: keep it and redraw (at most `refresh_per_second` times a second, and always at a
        round's last game)."""
        with self.lock:
            self.latest = progress
            if self.live is None:
                self.start_live()
            if self.live is None:
                return
            now = time.monotonic()
            round_over = progress.games_finished >= progress.games_total
            if round_over or now - self.last_refresh >= 1 / self.settings.refresh_per_second:
                self.last_refresh = now
                self.live.refresh()

    def renderable(self) -> RenderableType:
        latest = self.latest
        if latest is None:
            return waiting()
        if not latest.last_eval and self.evaluator is not None and self.evaluator.final_metrics:
            latest = dataclasses.replace(latest, last_eval=dict(self.evaluator.final_metrics))
        return render(latest)

    def start_live(self) -> None:
        """Start the live display where it may draw: after setup, on a terminal, and not while Lightning's bar is
        about to take the console over."""
        console = self.target()
        if not self.may_draw or self.unsupported or not console.is_terminal:
            return
        live = Live(
            console=console,
            get_renderable=self.renderable,
            refresh_per_second=self.settings.refresh_per_second,
            auto_refresh=False,  # `update` redraws: no thread of ours writes to the terminal
            transient=False,
        )
        try:
            live.start(refresh=True)
        except LiveError:  # rich < 14.1: one live display per console, and the progress bar holds it
            self.unsupported = True
            log.info("the self-play live view is off: this rich draws one live display at a time (the progress bar)")
            return
        self.live = live

    def stop_live(self) -> None:
        """Stop the live display (its last frame stays on screen); nothing when none is running."""
        with self.lock:
            live, self.live = self.live, None
            if live is None:
                return
            if holds(live.console, live):
                live.stop()
            else:  # another display reconfigured the console since: nothing of this one is registered to pop
                log.debug("the self-play live view's display was replaced on its console")

    def register(self) -> None:
        if not self.registered:
            self.variant.progress_listeners.append(self.update)
            self.registered = True

    def unregister(self) -> None:
        if self.registered:
            listeners = self.variant.progress_listeners
            if self.update in listeners:
                listeners.remove(self.update)
            self.registered = False

    # ---- Lightning hooks -----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero and self.active:
            self.register()
            self.may_draw = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Round 0 has played (the rollout loop's `on_fit_start` runs first); when a Rich bar is about to take the
        console over (at `on_train_start`, reconfiguring it), stop drawing until it has."""
        if isinstance(trainer.progress_bar_callback, RichProgressBar) and trainer.progress_bar_callback.is_enabled:
            with self.lock:
                self.may_draw = False
                self.stop_live()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with self.lock:
            self.may_draw = self.registered

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.stop()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop()
        self.unregister()

    def stop(self) -> None:
        """Stop drawing for good (idempotent); `latest` keeps the last report."""
        with self.lock:
            self.may_draw = False
            self.stop_live()


def holds(console: Console, live: Live) -> bool:
    """Whether `live` is still registered on `console`: Lightning's bar reconfigures the global console when it
    starts, which forgets every live display registered there (rich keeps them in `_live_stack`, or `_live`
    before 14.1)."""
    stack = getattr(console, "_live_stack", None)
    if stack is not None:
        return any(entry is live for entry in stack)
    return getattr(console, "_live", None) is live


def live_view(variant, evaluator=None, **keys) -> SelfPlayLiveView | None:
    """The `callbacks.live_view` entry: the view for a variant that reports its rounds (`ReportsProgress`), or
    none (disabled, or any other variant); `keys`: `LiveViewSettings`'."""
    if not LiveViewSettings(**keys).enabled or not isinstance(variant, ReportsProgress):
        return None
    return SelfPlayLiveView(variant, evaluator=evaluator, **keys)


configures(live_view, LiveViewSettings)
