"""What a self-play round reports while it plays: the record the live view (training/live_view.py) renders.

Kept apart from the variant so a view, a logger or a test can read it without the engine or the games.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class PoolEntry:
    """One opponent of the pool as the view shows it."""

    name: str
    """`learner`, `base`, `random`, `perfect` or a snapshot's `round<NNN>`."""
    mu: float
    sigma: float
    games: int
    """Games it has played against the learner, this run."""


@dataclass(frozen=True)
class SelfPlayProgress:
    """A round of games as it stands (the learner's results, from its seat)."""

    round_index: int
    game_id: str
    games_total: int
    games_finished: int
    wins: int
    draws: int
    losses: int
    learner_turns: int
    illegal_moves: int
    """Learner turns whose move was illegal (each ends its game as a loss)."""
    pool: tuple[PoolEntry, ...] = ()
    last_eval: dict[str, float] = field(default_factory=dict)
    """The latest evaluation's `eval/...` metrics (win / draw / loss rates with intervals); empty before one."""

    @property
    def games_in_flight(self) -> int:
        return self.games_total - self.games_finished

    @property
    def illegal_move_rate(self) -> float:
        return self.illegal_moves / self.learner_turns if self.learner_turns else 0.0


@runtime_checkable
class ReportsProgress(Protocol):
    """A variant that reports its rounds while they play: it calls each of `progress_listeners` with a
    `SelfPlayProgress` as games finish (from whichever thread plays them). A view registers by appending a
    callable; a variant without the list reports nothing, and the views built for it stay off."""

    progress_listeners: list
    """`list[Callable[[SelfPlayProgress], None]]`, called in order; a listener must return quickly."""
