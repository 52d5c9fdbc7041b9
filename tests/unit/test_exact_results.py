"""Exact results of scripted TicTacToe players against the random one, every game enumerated with the project's own
game and players, against values worked out independently (a separate enumeration over raw boards)."""

from __future__ import annotations

import functools
import random

import pytest

from grpo_lightning.games.exact import Expected, both_seats, expected_results
from grpo_lightning.games.play import SCRIPTED, PerfectPlayer, RandomMovePlayer, ScriptedPlayer, TacticPlayer
from grpo_lightning.games.tictactoe import LINES, TicTacToe


class LowestFreeCell(ScriptedPlayer):
    """Always the lowest free cell: what a model that learned only legality tends to play."""

    name = "lowest"

    def move_distribution(self, game):
        return {game.legal_moves()[0]: 1.0}


# ---- an independent enumeration over raw boards ---------------------------------------------------------------
def _winner(board):
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def _policy(name, board, mark):
    free = [i for i, c in enumerate(board) if c == "."]
    other = "O" if mark == "X" else "X"

    def completing(m):
        return [i for i in free if _winner(board[:i] + m + board[i + 1 :]) == m]

    if name == "random":
        return {i: 1 / len(free) for i in free}
    if name == "lowest":
        return {free[0]: 1.0}
    choices = completing(mark) or completing(other) or free  # tactic
    return {i: 1 / len(choices) for i in choices}


@functools.cache
def _raw(name, board, mark_to_move, mine, opponent="random"):
    won = _winner(board)
    if won is not None:
        return (1.0, 0.0, 0.0) if won == mine else (0.0, 0.0, 1.0)
    if "." not in board:
        return (0.0, 1.0, 0.0)
    dist = _policy(name if mark_to_move == mine else opponent, board, mark_to_move)
    nxt = "O" if mark_to_move == "X" else "X"
    total = [0.0, 0.0, 0.0]
    for cell, p in dist.items():
        w, d, lo = _raw(name, board[:cell] + mark_to_move + board[cell + 1 :], nxt, mine, opponent)
        total = [total[0] + p * w, total[1] + p * d, total[2] + p * lo]
    return tuple(total)


PLAYERS = {"random": RandomMovePlayer, "lowest": LowestFreeCell, "tactic": TacticPlayer, "perfect": PerfectPlayer}


@pytest.mark.parametrize("opponent", ["random", "tactic"])
@pytest.mark.parametrize("name", ["random", "lowest", "tactic"])
def test_against_an_independent_enumeration(name, opponent):
    seat0, seat1, _ = both_seats(TicTacToe, PLAYERS[name](), PLAYERS[opponent]())
    for seat, result in ((0, seat0), (1, seat1)):
        want = _raw(name, ".........", "X", "XO"[seat], opponent)
        assert (result.win, result.draw, result.loss) == pytest.approx(want, abs=1e-12)


def table_against(opponent: str) -> dict[str, Expected]:
    """Each scripted policy's exact results against `opponent`, both seats averaged."""
    return {name: both_seats(TicTacToe, player(), PLAYERS[opponent]())[2] for name, player in PLAYERS.items()}


def test_the_reference_table():
    """What each scripted policy is worth against the uniform-random legal player, both seats averaged
    (docs/selfplay.md).
    Perfect play never loses; the tactics (win, else block, else random) lose 3.7% of games."""
    table = table_against("random")
    rounded = {name: (round(e.win, 3), round(e.loss, 3)) for name, e in table.items()}
    assert rounded == {"random": (0.437, 0.437), "lowest": (0.611, 0.349), "tactic": (0.798, 0.037),
                       "perfect": (0.873, 0.0)}  # fmt: skip
    assert table["perfect"].loss == 0.0
    assert all(e.win + e.draw + e.loss == pytest.approx(1.0) for e in table.values())


def test_the_table_against_the_tactic_player():
    """What each scripted policy is worth against `tactic`, both seats averaged (docs/selfplay.md): the bar a
    learned policy's loss rate against it is measured by. Playing the lowest free cell loses 88.6% of games;
    the random player 79.8%; perfect play never loses."""
    table = table_against("tactic")
    rounded = {name: (round(e.win, 3), round(e.loss, 3)) for name, e in table.items()}
    assert rounded == {"random": (0.037, 0.798), "lowest": (0.013, 0.886), "tactic": (0.243, 0.243),
                       "perfect": (0.470, 0.0)}  # fmt: skip


def test_the_tactic_player_wins_then_blocks_then_plays_at_random():
    game = TicTacToe()
    game.reset(0)
    for move in ("[0]", "[3]", "[1]"):  # X threatens 2; O to move, with no win of its own: block at 2
        game.step(move)
    assert TacticPlayer().move_distribution(game) == {"[2]": 1.0}
    game.step("[4]")  # O does not block; X to move can win at 2
    assert TacticPlayer().move_distribution(game) == {"[2]": 1.0}
    fresh = TicTacToe()
    fresh.reset(0)
    assert TacticPlayer().move_distribution(fresh) == {f"[{i}]": 1 / 9 for i in range(9)}
    assert "tactic" in SCRIPTED and SCRIPTED["tactic"] is TacticPlayer


def test_sampled_games_agree_with_the_exact_rates():
    """The scripted players' `choose` draws from the same distribution the enumeration sums over."""
    rng, wins, n = random.Random(0), 0, 4000
    for _ in range(n):
        game = TicTacToe()
        game.reset(0)
        players = {0: TacticPlayer(), 1: RandomMovePlayer()}
        while not game.done:
            game.step(players[game.current_player].choose(game, rng))
        wins += game.outcome[0] > 0
    exact = expected_results(TicTacToe(), TacticPlayer(), RandomMovePlayer(), seat=0)
    assert abs(wins / n - exact.win) < 4 * (exact.win * (1 - exact.win) / n) ** 0.5
    assert isinstance(exact, Expected)
