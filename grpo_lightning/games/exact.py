"""Exact expected results of one scripted player against another, every game enumerated (no sampling).

A scripted player's move is drawn from an exact distribution (`ScriptedPlayer.move_distribution`), so the chance of
every game between two of them is a product of known probabilities, and its win, draw and loss rates are sums over
the game tree. Positions recur along different move orders, so each is valued once (memoised on `key`: by default
the rendered board and the player to move, which is the whole state of a board game like TicTacToe; a game whose
rendering hides state needs its own key). These are the numbers a learned policy is measured against: what a
scripted policy is worth against the random player, from each seat (docs/selfplay.md).

`best_response` is the other exact number: the most any strategy of one seat can win against a fixed strategy of
the other, in a game of imperfect information, and the strategy that wins it (Kuhn Poker's exploitability and its
`best_response` opponent, games/kuhn_poker.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.play import ScriptedPlayer


@dataclass(frozen=True)
class Expected:
    """Win, draw and loss probabilities of one player (they sum to 1), and its expected payoff
    (`TwoPlayerGame.payoff`: Kuhn Poker's chips; win - loss in games whose outcome is the whole result)."""

    win: float
    draw: float
    loss: float
    payoff: float

    @staticmethod
    def mean(results: list[Expected]) -> Expected:
        n = len(results)
        return Expected(
            sum(r.win for r in results) / n,
            sum(r.draw for r in results) / n,
            sum(r.loss for r in results) / n,
            sum(r.payoff for r in results) / n,
        )


def position_key(game: TwoPlayerGame) -> Hashable:
    """The rendered position and the player to move."""
    return game.render(), game.current_player


def expected_results(
    game: TwoPlayerGame,
    player: ScriptedPlayer,
    opponent: ScriptedPlayer,
    seat: int,
    key: Callable[[TwoPlayerGame], Hashable] = position_key,
    max_moves: int | None = None,
) -> Expected:
    """`player`'s exact results in `seat` against `opponent` from `game`'s current position (a game capped after
    `max_moves` more moves, as self-play's `max_turns`, is a draw)."""
    memo: dict[tuple[Hashable, int | None], Expected] = {}

    def value(position: TwoPlayerGame, moves_left: int | None) -> Expected:
        if position.done:
            result = position.outcome[seat]
            return Expected(float(result > 0), float(result == 0), float(result < 0), position.payoff[seat])
        if moves_left == 0:
            return Expected(0.0, 1.0, 0.0, 0.0)
        known = memo.get((key(position), moves_left))
        if known is not None:
            return known
        mover = player if position.current_player == seat else opponent
        win = draw = loss = payoff = 0.0
        for move, p in mover.move_distribution(position).items():
            after = copy.deepcopy(position)
            after.step(move)
            v = value(after, None if moves_left is None else moves_left - 1)
            win, draw, loss, payoff = win + p * v.win, draw + p * v.draw, loss + p * v.loss, payoff + p * v.payoff
        memo[key(position), moves_left] = Expected(win, draw, loss, payoff)
        return memo[key(position), moves_left]

    return value(copy.deepcopy(game), max_moves)


def both_seats(
    new_game: Callable[[], TwoPlayerGame],
    player: ScriptedPlayer,
    opponent: ScriptedPlayer,
    seeds: Sequence[int] = (0,),
) -> tuple[Expected, Expected, Expected]:
    """`player`'s exact results from seat 0, from seat 1, and their mean (as an evaluation that plays every seed
    from both seats reports them), each the mean over the games `seeds` deal (Kuhn Poker: 6 seeds, every deal)."""
    per_seat = []
    for seat in (0, 1):
        results = []
        for seed in seeds:
            game = new_game()
            game.reset(seed)
            results.append(expected_results(game, player, opponent, seat))
        per_seat.append(Expected.mean(results))
    return per_seat[0], per_seat[1], Expected.mean(per_seat)


def best_response(
    new_game: Callable[[], TwoPlayerGame],
    seeds: Sequence[int],
    seat: int,
    policy: Callable[[TwoPlayerGame], dict[str, float]],
    infoset: Callable[[TwoPlayerGame], Hashable],
) -> tuple[float, dict[Hashable, list[str]]]:
    """The expected payoff of `seat`'s best response to the other seat playing `policy` (its move distribution at a
    position), each game `seeds` deal equally likely (the chance node; Zinkevich et al. 2007, Johanson et al.
    2011), and the response: at each of `seat`'s information sets the legal moves that reach that payoff (several
    where they are worth the same, within 1e-12; any mix of them is a best response too). `infoset(position)`: what
    the responder knows when it moves there (its hidden card and the moves so far); it must pick the same move at
    every position of one information set, as a player who cannot see the other's card.

    Backward induction over the responder's information sets: each takes the legal move of the highest value summed
    over its positions, each weighted by its chance of being reached (the deal's and the policy's moves: the
    responder's own moves lead there for certain), with its later moves already chosen: an information set is
    chosen when a position of an earlier one first needs its value (with perfect recall no information set comes
    both before and after another, so this ends). A game of perfect information may key its information sets by the
    position alone, reached along several lines. An information set the policy never lets the responder reach is
    worth nothing either way: every legal move answers it.
    """
    roots = []
    for seed in seeds:
        roots.append(new_game())
        roots[-1].reset(seed)
    reached = _responder_positions(roots, seat, policy, infoset)
    answers: dict[Hashable, list[str]] = {}

    def chosen(key: Hashable) -> str:  # the information set's best move, its later ones chosen first
        if key not in answers:
            positions = reached[key]
            worth = {m: sum(r * value(after_move(g, m)) for r, g in positions) for m in positions[0][1].legal_moves()}
            best = max(worth.values())
            answers[key] = [m for m, w in worth.items() if w >= best - 1e-12]
        return answers[key][0]

    def value(position: TwoPlayerGame) -> float:  # the responder's payoff, its moves from here chosen
        if position.done:
            return position.payoff[seat]
        if position.current_player == seat:
            return value(after_move(position, chosen(infoset(position))))
        return sum(p * value(after_move(position, move)) for move, p in policy(position).items() if p > 0)

    for key in reached:
        chosen(key)
    return sum(value(root) for root in roots) / len(roots), answers


def _responder_positions(
    roots: list[TwoPlayerGame],
    seat: int,
    policy: Callable[[TwoPlayerGame], dict[str, float]],
    infoset: Callable[[TwoPlayerGame], Hashable],
) -> dict[Hashable, list[tuple[float, TwoPlayerGame]]]:
    """Every position where `seat` moves, by information set, each with its chance of being reached from a root
    (the policy's moves; the responder's own lead there for certain, the root's deal is 1 of `len(roots)`: the
    common factor is left out)."""
    reached: dict[Hashable, list[tuple[float, TwoPlayerGame]]] = {}

    def visit(position: TwoPlayerGame, reach: float) -> None:
        if position.done:
            return
        if position.current_player == seat:
            reached.setdefault(infoset(position), []).append((reach, position))
            for move in position.legal_moves():
                visit(after_move(position, move), reach)
        else:
            for move, p in policy(position).items():
                if p > 0:
                    visit(after_move(position, move), reach * p)

    for root in roots:
        visit(root, 1.0)
    return reached


def after_move(position: TwoPlayerGame, move: str) -> TwoPlayerGame:
    """A copy of `position` with `move` played (`position` left as it is)."""
    after = copy.deepcopy(position)
    after.step(move)
    return after
