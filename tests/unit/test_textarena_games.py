"""TextArena's games behind the TwoPlayerGame interface (games/textarena_games.py): the id rule and its table,
scripted games with known results, illegal moves, seeding, the caller's random streams, and the legal moves."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

textarena = pytest.importorskip("textarena")

from grpo_lightning.games.registry import check_game_id, make_game  # noqa: E402
from grpo_lightning.games.textarena_games import (  # noqa: E402
    NOT_HERE,
    OFFLINE_TWO_PLAYER,
    TextArenaGame,
    textarena_problem,
)

LEGAL_MOVE_GAMES = (
    "TicTacToe-v0",
    "Nim-v0",
    "KuhnPoker-v0",
    "ConnectFour-v0",
    "IteratedRockPaperScissors-v0",
    "IteratedMatchingPennies-v0",
)


def play(game: TextArenaGame, replies: list[str]) -> list:
    """Each reply's StepResult, in order."""
    return [game.step(reply) for reply in replies]


# ---- the id rule ------------------------------------------------------------------------------------------------


def test_the_table_covers_every_registered_id_once():
    from textarena.envs.registration import ENV_REGISTRY

    assert not OFFLINE_TWO_PLAYER & NOT_HERE.keys()
    assert OFFLINE_TWO_PLAYER | NOT_HERE.keys() == set(ENV_REGISTRY)


@pytest.mark.parametrize("env_id", ["TicTacToe-v0", "TicTacToe-v0-train", "TicTacToe-v0-raw", "Nim-v0", "KuhnPoker-v0"])
def test_offline_two_player_games_pass(env_id):
    assert check_game_id(f"textarena:{env_id}") is None


def test_an_unknown_id_names_close_ones():
    problem = check_game_id("textarena:TicTacToe-v9")
    assert problem.startswith("must be a TextArena env id; close: ") and "TicTacToe-v0" in problem
    assert check_game_id("textarena:Zzzzzz") == "must be a TextArena env id (docs/selfplay.md lists them)"
    with pytest.raises(ValueError, match=r"game id must be a TextArena env id; close: .* \(got 'textarena:Nim-v9'\)"):
        make_game("textarena:Nim-v9")


@pytest.mark.parametrize(
    ("env_id", "reason"),
    [
        ("Wordle-v0", "downloads nltk data"),  # nltk.download at import; the sandbox and CI have no network
        ("Hangman-v0", "downloads nltk data"),
        ("Debate-v0", "calls OpenRouter"),  # an OpenRouter jury decides the debate
        ("Chess-v0", "needs Python 3.12"),  # f-strings that reuse their quotes (PEP 701)
        ("SecretMafia-v0", "is for more than two players"),
        ("ThreePlayerTicTacToe-v0", "is for more than two players"),
        ("Sudoku-v0", "is for one player"),
    ],
)
def test_games_that_cannot_run_here_say_why(env_id, reason):
    assert check_game_id(f"textarena:{env_id}") == (
        f"must be a two-player TextArena game that runs offline (docs/selfplay.md); textarena:{env_id} {reason}"
    )


def test_without_textarena_the_rule_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textarena" else find_spec(name))
    assert textarena_problem("TicTacToe-v0") == "needs textarena: pip install -e '.[games]' (make install does)"


def test_make_game_makes_a_textarena_game_and_refuses_the_rest():
    game = make_game("textarena:Nim-v0")
    assert isinstance(game, TextArenaGame) and game.game_id == "textarena:Nim-v0"
    with pytest.raises(ValueError, match="textarena:Wordle-v0 downloads nltk data"):
        make_game("textarena:Wordle-v0")


# ---- scripted games ---------------------------------------------------------------------------------------------


def test_a_scripted_tictactoe_win_for_seat_0():
    game = TextArenaGame("TicTacToe-v0")
    movers, results = [], []
    for reply in ["[4]", "[0]", "[3]", "[1]", "[5]"]:  # seat 0 takes the middle row
        movers.append(game.current_player)
        results.append(game.step(reply))
    assert movers == [0, 1, 0, 1, 0]
    assert [r.illegal for r in results] == [False] * 5
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].outcome == (1.0, -1.0) == game.outcome and game.done


def test_a_scripted_tictactoe_win_for_seat_1_and_a_draw():
    game = TextArenaGame("TicTacToe-v0-raw")
    *_, last = play(game, ["[0]", "[4]", "[1]", "[2]", "[8]", "[6]"])  # seat 1: 4, 2, 6 (a diagonal)
    assert (last.illegal, last.done, last.outcome) == (False, True, (-1.0, 1.0))
    game.reset(1)
    results = play(game, ["[4]", "[0]", "[2]", "[6]", "[3]", "[5]", "[1]", "[7]", "[8]"])
    assert not any(r.illegal for r in results) and results[-1].done and results[-1].outcome == (0.0, 0.0)


@pytest.mark.parametrize(
    ("replies", "mover", "outcome"),
    [
        (["[4]", "[4]"], 1, (1.0, -1.0)),  # seat 1 plays the occupied centre
        (["hello"], 0, (-1.0, 1.0)),  # not a move (textarena's wrapper makes it "[hello]")
        (["[4]", "[9]"], 1, (1.0, -1.0)),  # no such cell
    ],
)
def test_an_illegal_reply_loses_at_once(replies, mover, outcome):
    game = TextArenaGame("TicTacToe-v0")
    *before, result = play(game, replies)
    assert not any(r.illegal for r in before)
    assert result.illegal and result.done and result.outcome == outcome
    assert game.state.game_info[mover]["invalid_move"]  # textarena agrees: its error allowance is 0
    with pytest.raises(RuntimeError, match="game is over"):
        game.step("[0]")


@pytest.mark.parametrize("env_id", ["LiarsDice-v0", "Poker-v0", "KuhnPoker-v0"])
def test_an_illegal_reply_loses_whatever_the_state_class(env_id):
    """Multi-player states give a retry or eliminate the player; the game ends here with the mover's loss."""
    game = TextArenaGame(env_id)
    mover = game.current_player
    result = game.step("[this is not a move]")
    assert result.illegal and result.done
    assert result.outcome == ((-1.0, 1.0) if mover == 0 else (1.0, -1.0))


def test_a_game_that_judges_bad_moves_itself_keeps_its_result():
    """Snake kills the snake of a bad move without telling its state: not flagged, but the mover has lost."""
    game = TextArenaGame("Snake-v0")
    result = game.step("[this is not a move]")
    assert not result.illegal and result.done and result.outcome == (-1.0, 1.0)


# ---- observations and seeds -------------------------------------------------------------------------------------


def test_observations_are_one_text_that_reading_does_not_change():
    game = TextArenaGame("TicTacToe-v0")
    first = game.observation(0)
    assert "You are Player 0 in Tic Tac Toe" in first and "Available Moves" in first
    assert game.observation(1) == game.observation(1) and "You are Player 1" in game.observation(1)
    assert game.observation(0) == first
    game.step("[4]")
    seen = game.observation(1)
    assert "Player 0 placed their symbol" in seen and "You are Player 1" in seen
    raw = TextArenaGame("TicTacToe-v0-raw")  # no observation wrapper: the messages are put together here
    assert raw.observation(0).startswith("[GAME] You are Player 0 in Tic Tac Toe")


def test_the_same_seed_gives_the_same_game():
    game = TextArenaGame("KuhnPoker-v0")
    game.reset(3)
    first = game.observation(game.current_player)
    play(game, ["[bet]", "[fold]", "[check]"])
    game.reset(3)  # a new environment: KuhnPoker would deal from the deck it shuffled last game
    assert game.observation(game.current_player) == first
    deals = set()
    for seed in range(8):
        game.reset(seed)
        deals.add(game.observation(game.current_player))
    assert len(deals) > 1


def test_the_callers_random_streams_do_not_move_and_do_not_steer_the_game():
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    def unchanged() -> bool:
        py, npy, th = random.getstate(), np.random.get_state(), torch.get_rng_state()
        return (
            py == before[0]
            and all(np.array_equal(a, b) for a, b in zip(npy, before[1], strict=True))
            and torch.equal(th, before[2])
        )

    seen = []
    for _ in range(2):
        game = TextArenaGame("KuhnPoker-v0")  # make + reset(0)
        assert unchanged()
        game.reset(5)  # textarena's State calls random.seed(5); KuhnPoker shuffles with random.shuffle
        assert unchanged()
        observations = [game.observation(game.current_player), game.observation(1 - game.current_player)]
        while not game.done:
            game.legal_moves()
            game.step("[check]" if "[check]" in game.legal_moves() else "[call]")
            observations.append(game.observation(game.current_player))
            assert unchanged()
        seen.append(observations)
    assert seen[0] == seen[1]

    # the caller drawing between moves leaves the game's draws alone
    game = TextArenaGame("KuhnPoker-v0")
    game.reset(5)
    observations = [game.observation(game.current_player), game.observation(1 - game.current_player)]
    while not game.done:
        random.random(), np.random.random()
        game.step("[check]" if "[check]" in game.legal_moves() else "[call]")
        observations.append(game.observation(game.current_player))
    assert observations == seen[0]


# ---- legal moves ------------------------------------------------------------------------------------------------


def _replay(env_id: str, seed: int, moves: list[str]) -> TextArenaGame:
    game = TextArenaGame(env_id)
    game.reset(seed)
    for move in moves:
        assert not game.step(move).illegal, (env_id, moves)
    return game


@pytest.mark.parametrize("env_id", LEGAL_MOVE_GAMES)
def test_every_legal_move_is_accepted(env_id):
    """From the first position and from two later ones reached by random legal play, each legal move is legal."""
    rng = random.Random(0)
    game = _replay(env_id, 0, [])
    history: list[str] = []
    checkpoints = {0, 3, 6}
    for turn in range(7):
        if game.done:
            break
        legal = game.legal_moves()
        assert legal, (env_id, history)
        if turn in checkpoints:
            for move in legal:
                trial = _replay(env_id, 0, history)
                assert not trial.step(move).illegal, (env_id, history, move)
        move = rng.choice(legal)
        assert not game.step(move).illegal
        history.append(move)


def test_legal_moves_leave_out_illegal_ones():
    game = TextArenaGame("Nim-v0")  # piles 3, 4, 5
    assert game.legal_moves()[:4] == ["[0 1]", "[0 2]", "[0 3]", "[1 1]"] and len(game.legal_moves()) == 12
    assert game.step("[0 4]").illegal
    game = TextArenaGame("TicTacToe-v0")
    game.step("[4]")
    assert "[4]" not in game.legal_moves() and len(game.legal_moves()) == 8
    assert TextArenaGame("Othello-v0").legal_moves() == []  # unknown here: the random player cannot play it
