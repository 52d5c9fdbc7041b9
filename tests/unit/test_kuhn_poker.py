"""Kuhn Poker: the rules by hand, and its equilibrium checked against every pure strategy of either seat (the game
value is -1/18 chips a game for the first seat; no strategy does better against the equilibrium)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from grpo_lightning.games.exact import both_seats
from grpo_lightning.games.kuhn_poker import DEALS, KuhnPoker
from grpo_lightning.games.play import PerfectPlayer, RandomMovePlayer, ScriptedPlayer
from grpo_lightning.games.registry import make_game


def play(seed: int, *moves: str) -> KuhnPoker:
    game = KuhnPoker()
    game.reset(seed)
    for move in moves:
        game.step(f"I {move} [{move}]")
    return game


@pytest.mark.parametrize(
    ("moves", "chips_if_seat0_higher"),
    [(("check", "check"), 1), (("bet", "call"), 2), (("check", "bet", "call"), 2), (("bet", "fold"), 1),
     (("check", "bet", "fold"), -1)],
)  # fmt: skip
def test_every_line_of_play_by_hand(moves, chips_if_seat0_higher):
    for seed, (mine, theirs) in enumerate(DEALS):
        game = play(seed, *moves)
        assert game.done
        showdown = "fold" not in moves
        expected = chips_if_seat0_higher * (1 if mine > theirs or not showdown else -1)
        assert game.chips == expected and game.outcome == ((1.0, -1.0) if expected > 0 else (-1.0, 1.0))


def test_legal_moves_and_an_illegal_move_loses():
    game = play(0)
    assert game.legal_moves() == ["[check]", "[bet]"] and game.current_player == 0
    game.step("[bet]")
    assert game.legal_moves() == ["[call]", "[fold]"] and game.current_player == 1
    result = game.step("[check]")  # not legal facing a bet
    assert result.illegal and game.outcome == (1.0, -1.0)
    assert play(1).step("no move").outcome == (-1.0, 1.0)
    assert [play(s).cards for s in range(6)] == list(DEALS) and play(6).cards == DEALS[0]
    assert make_game("kuhn_poker").game_id == "kuhn_poker"


# ---- the equilibrium -----------------------------------------------------------------------------------------------
def chips(strategies: dict[int, callable], payoff=lambda game: Fraction(game.chips)) -> Fraction:
    """Seat 0's exact chips a game (or another `payoff` of the finished game), averaged over the 6 deals, each
    seat's move drawn from its strategy (a function (card, history) -> {move: probability}), in exact fractions."""
    total = Fraction(0)
    for cards in DEALS:

        def value(history: tuple[str, ...], cards=cards) -> Fraction:
            game = KuhnPoker()
            game.cards = cards
            for move in history:
                game.step(f"[{move}]")
            if game.done:
                return payoff(game)
            seat = len(history) % 2
            return sum(p * value((*history, m)) for m, p in strategies[seat](cards[seat], history).items())

        total += value(())
    return total / len(DEALS)


def equilibrium(card: int, history: tuple[str, ...]) -> dict[str, Fraction]:
    game = KuhnPoker()
    other = next(c for c in range(3) if c != card)  # only the mover's own card matters to its move
    game.cards = (card, other) if len(history) % 2 == 0 else (other, card)
    for move in history:
        game.history.append(move)
    return {m[1:-1]: Fraction(p).limit_denominator(9) for m, p in game.optimal_distribution().items()}


def pure_strategies():
    """Every pure strategy of a seat: one move at each (card, history) it can face."""
    situations = {0: [((), ("check", "bet")), (("check", "bet"), ("call", "fold"))],
                  1: [(("check",), ("check", "bet")), (("bet",), ("call", "fold"))]}  # fmt: skip
    for seat, places in situations.items():
        keys = [(card, history, options) for card in range(3) for history, options in places]
        for choice in itertools.product(*(options for _, _, options in keys)):
            table = {(card, history): move for (card, history, _), move in zip(keys, choice, strict=True)}
            yield seat, (lambda card, history, table=table: {table[card, history]: Fraction(1)})


def test_the_equilibrium_is_one():
    value = chips({0: equilibrium, 1: equilibrium})
    assert value == Fraction(-1, 18)
    best = {0: max, 1: min}
    for seat, strategy in pure_strategies():  # 64 a seat: none beats the equilibrium
        mixed = {seat: strategy, 1 - seat: equilibrium}
        assert best[seat](chips(mixed), value) == value


def uniform(card: int, history: tuple[str, ...]) -> dict[str, Fraction]:
    options = ("call", "fold") if history and history[-1] == "bet" else ("check", "bet")
    return {m: Fraction(1, 2) for m in options}


def test_exact_results_against_the_random_player_average_the_deals():
    """Over the 6 deals from both seats, against the independent enumeration above: the random player wins half its
    games against itself; the equilibrium, which maximises chips rather than wins (it folds a J to a bet), wins
    fewer than half of its games against the random player while winning chips from it."""
    _, _, even = both_seats(KuhnPoker, RandomMovePlayer(), RandomMovePlayer(), seeds=range(6))
    assert even.win == pytest.approx(0.5) and even.draw == 0.0
    first, second, mean = both_seats(KuhnPoker, PerfectPlayer(), RandomMovePlayer(), seeds=range(6))
    won_first = chips({0: equilibrium, 1: uniform}, payoff=lambda game: Fraction(game.chips > 0))
    won_second = chips({0: uniform, 1: equilibrium}, payoff=lambda game: Fraction(game.chips < 0))
    assert (first.win, second.win) == (pytest.approx(float(won_first)), pytest.approx(float(won_second)))
    assert mean.win == pytest.approx(float(won_first + won_second) / 2) and mean.win < 0.5
    assert chips({0: equilibrium, 1: uniform}) > 0 and chips({0: uniform, 1: equilibrium}) < 0


def test_the_expected_payoff_is_the_chips_of_the_independent_enumeration():
    """games/exact.py's expected payoff (chips) against the enumeration above, from each seat: the equilibrium
    against itself is the game value, -1/18 from the first seat and +1/18 from the second; against the random
    player it wins chips from both seats, though fewer than half of its games."""
    first, second, _ = both_seats(KuhnPoker, PerfectPlayer(), PerfectPlayer(), seeds=range(6))
    assert (first.payoff, second.payoff) == (pytest.approx(-1 / 18), pytest.approx(1 / 18))
    first, second, mean = both_seats(KuhnPoker, PerfectPlayer(), RandomMovePlayer(), seeds=range(6))
    assert first.payoff == pytest.approx(float(chips({0: equilibrium, 1: uniform})))
    assert second.payoff == pytest.approx(float(-chips({0: uniform, 1: equilibrium})))
    assert mean.payoff > 0 and mean.win < 0.5
    assert play(2, "bet", "call").payoff == (2.0, -2.0) and play(0, "bet", "call").payoff == (-2.0, 2.0)
    assert play(0, "bet", "fold").payoff == (1.0, -1.0)  # seed 2 deals Q against J, seed 0 J against Q
    assert KuhnPoker.payoff_unit == "chips" and KuhnPoker().payoff is None


class Rule(ScriptedPlayer):
    """A pure rule: `first` when no bet is faced (check or bet), `facing` when one is (call or fold)."""

    def __init__(self, first: str, facing: str) -> None:
        self.name, self.first, self.facing = f"{first}/{facing}", first, facing

    def move_distribution(self, game):
        return {f"[{self.first if '[check]' in game.legal_moves() else self.facing}]": 1.0}


def test_the_table_of_docs_selfplay():
    """docs/selfplay.md's Kuhn Poker table: win rate and chips a hand, both seats averaged over every deal."""
    players = {"random": RandomMovePlayer(), "check/call": Rule("check", "call"), "check/fold": Rule("check", "fold"),
               "bet/call": Rule("bet", "call"), "perfect": PerfectPlayer()}  # fmt: skip
    table = {
        (name, against): both_seats(KuhnPoker, player, opponent, seeds=range(6))[2]
        for name, player in players.items()
        for against, opponent in (("random", RandomMovePlayer()), ("perfect", PerfectPlayer()))
    }
    rounded = {key: (round(e.win, 3), round(e.payoff, 3)) for key, e in table.items()}
    assert rounded == {
        ("random", "random"): (0.5, 0.0), ("random", "perfect"): (0.542, -0.111),
        ("check/call", "random"): (0.5, 0.0), ("check/call", "perfect"): (0.5, -0.111),
        ("check/fold", "random"): (0.25, -0.5), ("check/fold", "perfect"): (0.444, -0.111),
        ("bet/call", "random"): (0.688, 0.375), ("bet/call", "perfect"): (0.611, -0.111),
        ("perfect", "random"): (0.458, 0.111), ("perfect", "perfect"): (0.5, 0.0),
    }  # fmt: skip
