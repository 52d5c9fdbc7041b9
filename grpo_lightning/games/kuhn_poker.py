"""Kuhn Poker, built in (Kuhn 1950): the smallest poker with bluffing, a second game beside TicTacToe.

Three cards, J < Q < K; each seat antes 1 chip and is dealt one card, the third unseen. Seat 0 acts first:
`[check]` or `[bet]` (1 chip). After a check, seat 1 checks (showdown for the 2-chip pot) or bets; facing a bet, a
player `[call]`s (showdown for 4 chips) or `[fold]`s (the bettor takes the pot). The higher card wins a showdown.
`chips` is what seat 0 won (+1 or +2, or -1 or -2); the outcome the trainer sees is its sign (there are no draws).
An unreadable or illegal move loses the game at once, as in TicTacToe, and the ante (1 chip). `payoff` is the chips
each seat won, what a poker player is judged by: a hand won by folding the opponent wins less than a called bet.

The deal is the seed's: `reset(seed)` deals `DEALS[seed % 6]`, so any 6 consecutive seeds play every deal once
(an evaluation over them averages over the chance node exactly).

`optimal_distribution` is a Nash equilibrium of the game (Kuhn's family at alpha = 0: seat 0 never bets first; with
a Q it calls a bet a third of the time; seat 1 bets a J after a check a third of the time and calls a bet with a Q a
third of the time): against it no strategy wins more than -1/18 chips a game from seat 0 or +1/18 from seat 1, on
average over the deals; the `perfect` scripted player plays it.

A strategy of the game is a move distribution at each of its 12 information sets (`INFOSETS`: the mover's card and
the moves so far, all a player knows), keyed as `EQUILIBRIUM` is. `exploitability` says how far one is from an
equilibrium: what a best response wins against it, on the seats' mean (games/exact.py; docs/selfplay.md,
"Exploitability (Kuhn Poker)").
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping

from grpo_lightning.games.base import StepResult, TwoPlayerGame
from grpo_lightning.games.exact import best_response
from grpo_lightning.games.registry import register_game

CARDS = "JQK"
DEALS = tuple(itertools.permutations(range(3), 2))
"""The 6 deals: (seat 0's card, seat 1's card), card indices into CARDS."""
MOVES = ("check", "bet", "call", "fold")
EQUILIBRIUM: dict[tuple[int, str], dict[str, float]] = {
    # (card, history) -> the move distribution of the player to move; history: the moves so far, joined by ","
    (0, ""): {"check": 1.0},
    (1, ""): {"check": 1.0},
    (2, ""): {"check": 1.0},
    (0, "check,bet"): {"fold": 1.0},
    (1, "check,bet"): {"call": 1 / 3, "fold": 2 / 3},
    (2, "check,bet"): {"call": 1.0},
    (0, "check"): {"bet": 1 / 3, "check": 2 / 3},
    (1, "check"): {"check": 1.0},
    (2, "check"): {"bet": 1.0},
    (0, "bet"): {"fold": 1.0},
    (1, "bet"): {"call": 1 / 3, "fold": 2 / 3},
    (2, "bet"): {"call": 1.0},
}
"""Kuhn's equilibrium with alpha = 0, by the card of the player to move and the history."""
INFOSETS: tuple[tuple[int, str], ...] = tuple(EQUILIBRIUM)
"""The 12 information sets, (card of the player to move, history): seat 0's at "" and "check,bet", seat 1's at
"check" and "bet", each with the three cards."""
Strategy = Mapping[tuple[int, str], Mapping[str, float]]
"""A move distribution at every information set, moves named without brackets (`EQUILIBRIUM`'s form); a move left
out has probability 0."""


@register_game("kuhn_poker")
class KuhnPoker(TwoPlayerGame):
    longest_game = 3
    payoff_unit = "chips"

    def __init__(self) -> None:
        self.cards = DEALS[0]
        self.history: list[str] = []
        self._outcome: tuple[float, float] | None = None
        self.chips = 0
        """What seat 0 won (seat 1 won the opposite), once the game is over."""

    def reset(self, seed: int) -> None:
        self.cards, self.history, self._outcome, self.chips = DEALS[seed % len(DEALS)], [], None, 0

    @property
    def current_player(self) -> int:
        return len(self.history) % 2

    @property
    def outcome(self) -> tuple[float, float] | None:
        return self._outcome

    @property
    def payoff(self) -> tuple[float, float] | None:
        """The chips each seat won: (chips, -chips) once the game is over."""
        return None if self._outcome is None else (float(self.chips), float(-self.chips))

    def legal_moves(self) -> list[str]:
        if self.done:
            return []
        facing_bet = bool(self.history) and self.history[-1] == "bet"
        return ["[call]", "[fold]"] if facing_bet else ["[check]", "[bet]"]

    @property
    def solved(self) -> bool:
        return True

    def optimal_moves(self) -> list[str]:
        """The moves the equilibrium plays with a positive probability."""
        return [f"[{move}]" for move in self._equilibrium()]

    def optimal_distribution(self) -> dict[str, float]:
        """The equilibrium's mixed move: each move with its probability."""
        return {f"[{move}]": p for move, p in self._equilibrium().items()}

    def _equilibrium(self) -> dict[str, float]:
        return EQUILIBRIUM[self.cards[self.current_player], ",".join(self.history)]

    responds_exactly = True

    def strategy_positions(self) -> list[TwoPlayerGame]:
        """A position at each of the 12 information sets, `INFOSETS`' order."""
        return [position(card, history) for card, history in INFOSETS]

    def information_set(self) -> tuple[int, str]:
        return information_set(self)

    def best_response(self, strategy: Mapping[Hashable, Mapping[str, float]]) -> dict[Hashable, dict[str, float]]:
        """`best_response_strategy` of `strategy` read in the game's move format (`[check]`), answered in it."""
        answer = best_response_strategy(_unbracketed(strategy))
        return {key: {f"[{move}]": p for move, p in moves.items()} for key, moves in answer.items()}

    def exploitability(self, strategy: Mapping[Hashable, Mapping[str, float]]) -> float:
        return exploitability(_unbracketed(strategy))

    def render(self) -> str:
        return ", ".join(f"seat {i % 2} {move}s" for i, move in enumerate(self.history)) or "no moves yet"

    def observation(self, player: int) -> str:
        order = "you act first" if player == 0 else "your opponent acts first"
        return (
            "You are playing Kuhn Poker: a deck of three cards, J < Q < K. Each player antes 1 chip and holds one "
            f"card; the higher card wins at showdown. {order.capitalize()}. Check or bet 1 chip; facing a bet, call "
            "or fold.\n\n"
            f"Your card: {CARDS[self.cards[player]]}\nSo far: {self.render()}\n\n"
            f"Legal moves: {', '.join(self.legal_moves())}\nReply with your move in square brackets, e.g. "
            f"{self.legal_moves()[0] if self.legal_moves() else '[check]'}."
        )

    def step(self, reply: str) -> StepResult:
        seat = self.current_player
        move = self.move_in(reply)
        if move is None or move not in self.legal_moves():
            self._finish(-1 if seat == 0 else 1)
            return StepResult(illegal=True, done=True, outcome=self._outcome)
        self.history.append(move[1:-1])
        moves = ",".join(self.history)
        showdown = 1 if self.cards[0] > self.cards[1] else -1
        if moves == "check,check":
            self._finish(showdown)
        elif moves in ("bet,call", "check,bet,call"):
            self._finish(2 * showdown)
        elif moves == "bet,fold":
            self._finish(1)
        elif moves == "check,bet,fold":
            self._finish(-1)
        return StepResult(illegal=False, done=self.done, outcome=self._outcome)

    def _finish(self, chips: int) -> None:
        self.chips = chips
        self._outcome = (1.0, -1.0) if chips > 0 else (-1.0, 1.0)


def information_set(game: KuhnPoker) -> tuple[int, str]:
    """What the player to move knows: its card and the moves so far (an `INFOSETS` key)."""
    return game.cards[game.current_player], ",".join(game.history)


def position(card: int, history: str) -> KuhnPoker:
    """A game at an information set: the player to move holds `card`, after the moves of `history` (the other card
    is the first deal's that fits; the mover's observation does not show it)."""
    game = KuhnPoker()
    moves = history.split(",") if history else []
    game.reset(next(seed for seed, deal in enumerate(DEALS) if deal[len(moves) % 2] == card))
    for move in moves:
        game.step(f"[{move}]")
    return game


def _best_responses(strategy: Strategy) -> list[tuple[float, dict[Hashable, list[str]]]]:
    """`exact.best_response` from seat 0 against `strategy` in seat 1, then from seat 1 against it in seat 0."""
    _check_strategy(strategy)

    def policy(game: TwoPlayerGame) -> dict[str, float]:
        return {f"[{move}]": p for move, p in strategy[information_set(game)].items()}

    return [best_response(KuhnPoker, range(len(DEALS)), seat, policy, information_set) for seat in (0, 1)]


def best_response_values(strategy: Strategy) -> tuple[float, float]:
    """The chips a hand a best response wins against `strategy` (Zinkevich et al. 2007), averaged over the 6
    deals: from seat 0 against `strategy` in seat 1, and from seat 1 against it in seat 0. At an equilibrium they
    are the game's values, -1/18 and +1/18."""
    (first, _), (second, _) = _best_responses(strategy)
    return first, second


def best_response_strategy(strategy: Strategy) -> dict[tuple[int, str], dict[str, float]]:
    """A best response to `strategy` at all 12 information sets (`Strategy`'s form): seat 0's answer `strategy`
    playing seat 1 and seat 1's answer it playing seat 0 (a seat's information sets are its own, so one strategy
    holds both). Where several moves are worth the same it mixes them uniformly (every mix of best replies is one);
    an information set `strategy` never lets the responder reach (a move it never makes) takes every legal move
    alike. Self-play's `best_response` opponent plays it (docs/selfplay.md)."""
    answers: dict[Hashable, list[str]] = {}
    for _, seat_answers in _best_responses(strategy):
        answers |= seat_answers
    out = {}
    for key in INFOSETS:
        moves = answers.get(key) or position(*key).legal_moves()
        out[key] = {move[1:-1]: 1.0 / len(moves) for move in moves}
    return out


def _unbracketed(strategy: Mapping[Hashable, Mapping[str, float]]) -> Strategy:
    """A strategy with moves in the game's format (`[check]`) in `Strategy`'s form (`check`)."""
    return {key: {move.strip("[]"): p for move, p in moves.items()} for key, moves in strategy.items()}


def exploitability(strategy: Strategy) -> float:
    """How much a best response wins against `strategy`, in chips a hand on the seats' mean:
    (`best_response_values`' sum) / 2, the NashConv over the 2 players (Lanctot et al. 2019). 0 exactly at an
    equilibrium (Kuhn's family, any alpha in [0, 1/3]), positive elsewhere: 1/3 for always check and call,
    11/24 for the uniformly random player, 1 for always check and fold (docs/selfplay.md)."""
    return sum(best_response_values(strategy)) / 2


def _check_strategy(strategy: Strategy) -> None:
    """Every information set, with a distribution over its legal moves (sums to 1 within 1e-9)."""
    for key in INFOSETS:
        if key not in strategy:
            raise ValueError(f"the strategy has no move distribution at {CARDS[key[0]]}, history {key[1]!r}")
        legal = {move[1:-1] for move in position(*key).legal_moves()}
        moves = strategy[key]
        if not set(moves) <= legal or any(p < 0 for p in moves.values()) or abs(sum(moves.values()) - 1) > 1e-9:
            raise ValueError(
                f"the strategy at {CARDS[key[0]]}, history {key[1]!r} is not a distribution over {sorted(legal)}: "
                f"{dict(moves)}"
            )
