"""Reward terms of self-play turns (variant=selfplay, reward=selfplay; docs/selfplay.md).

Each learner turn is scored on its own, with the game's record (`types.TurnRecord`) as `info["record"]`: the
game's outcome for the learner, whether the move was legal and whether the reply was in the move format. They go
through the reward pipeline like any other terms, so weights, per-completion transforms (the role baseline,
rewards/transforms.py) and group transforms apply as configured.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from grpo_lightning.rewards.base import RewardResult, RewardTerm
from grpo_lightning.types import TurnRecord


def _turn(info: dict[str, Any]) -> TurnRecord:
    record = info.get("record")
    if not isinstance(record, TurnRecord):
        raise TypeError(f"a game reward term scores self-play turns (variant=selfplay); got record {record!r}")
    return record


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number (got {value!r})")
    return float(value)


GAME_RECORDS = "data=games variant=selfplay"
"""What gives a game term its records: the turns of games played by self-play (docs/selfplay.md)."""


def _discount(value) -> float:
    discount = _finite("discount", value)
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be in (0, 1] (got {value!r})")
    return discount


def _weight_of_turn(turn: TurnRecord, discount: float) -> float:
    """discount ** (the learner's turns after this one in its game): 1 for its last move."""
    turns_after = turn.learner_turns - 1 - turn.turn
    if turns_after < 0:
        raise ValueError(f"turn {turn.turn} of a game in which the learner had {turn.learner_turns} turns")
    return discount**turns_after


class GameOutcome(RewardTerm):
    """The learner's result of the game the turn belongs to: `win`, `draw` or `loss` (default +1 / 0 / -1),
    times `discount` ** (the learner's turns after this one in its game).

    At `discount` 1 (the default) every turn of a game gets the game's result: the credit of a move is the game it
    led to, and the group's other games (same game, seed, seat and opponent) are its baseline. Below 1 the credit
    is per move, by distance from the end, as a discounted return is: the learner's last move, the one that won or
    after which the game was lost (a missed block), carries the whole result and a move k turns earlier carries
    discount ** k of it, so a game lost by its last move no longer blames the sound opening as much (docs/
    selfplay.md). It reports the move as the extracted answer, so `rollout/format_rate` is the share of replies
    with a bracketed move."""

    needs_record: ClassVar[bool] = True
    record_source: ClassVar[str] = GAME_RECORDS
    reports_answer: ClassVar[bool] = True

    def __init__(self, win: float = 1.0, draw: float = 0.0, loss: float = -1.0, discount: float = 1.0) -> None:
        self.values = {1.0: _finite("win", win), 0.0: _finite("draw", draw), -1.0: _finite("loss", loss)}
        self.discount = _discount(discount)

    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        turn = _turn(info)
        value = self.values[turn.outcome] * _weight_of_turn(turn, self.discount)
        return RewardResult(reward=value, extracted=turn.move, correct=turn.outcome > 0)


class GamePayoff(RewardTerm):
    """The learner's payoff of the game the turn belongs to, in the game's unit (Kuhn Poker's chips: +-1 for a
    fold, +-2 for a called bet; the outcome in games where that is all), times `discount` ** (the learner's turns
    after this one), as GameOutcome's. What a poker player is judged by: a hand won by a fold is worth half a called
    bet, and the win rate alone would train a player to win small pots and lose big ones (docs/selfplay.md)."""

    needs_record: ClassVar[bool] = True
    record_source: ClassVar[str] = GAME_RECORDS
    reports_answer: ClassVar[bool] = True

    def __init__(self, discount: float = 1.0) -> None:
        self.discount = _discount(discount)

    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        turn = _turn(info)
        value = turn.payoff * _weight_of_turn(turn, self.discount)
        return RewardResult(reward=value, extracted=turn.move, correct=turn.outcome > 0)


class LegalMove(RewardTerm):
    """`legal` for a legal move, `illegal` for an illegal one (default 0 / -1): the first thing a small model
    can learn, with a signal in every turn rather than once a game."""

    needs_record: ClassVar[bool] = True
    record_source: ClassVar[str] = GAME_RECORDS

    def __init__(self, legal: float = 0.0, illegal: float = -1.0) -> None:
        self.legal, self.illegal = _finite("legal", legal), _finite("illegal", illegal)

    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        value = self.illegal if _turn(info).illegal else self.legal
        return RewardResult(reward=value, extracted=None, correct=False)


class MoveFormat(RewardTerm):
    """1 when the reply holds a bracketed move (legal or not), else 0."""

    needs_record: ClassVar[bool] = True
    record_source: ClassVar[str] = GAME_RECORDS

    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        return RewardResult(reward=float(_turn(info).move is not None), extracted=None, correct=False)
