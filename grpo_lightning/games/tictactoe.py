"""TicTacToe, built in: the tests' game and the default of `experiment=selfplay_tictactoe` (no third-party package).

Seat 0 plays X and moves first. A move is a cell number in square brackets, `[0]` to `[8]`; anything else, or an
occupied cell, is illegal and loses the game at once (an illegal move is the first thing a small model can learn
not to make). Every game starts from the empty board: the seed changes no rule and no position.

`tictactoe_shuffled` is the same game whose prompt lists the legal moves in a seeded random order each turn, and
whose example move is drawn from that order, where `tictactoe` lists them in ascending order and shows `[4]`: a
policy that copies the list's first entry plays the lowest free cell there and a random cell here (docs/selfplay.md,
"Keeping the spread"). The order is the game seed's and the turn's (`shuffled_moves`), so it is the same after a
resume, on every rank and in every game of a self-play group (which share a seed). The rules, the legal moves
(`legal_moves`, ascending, which the scripted players draw from) and every position are `tictactoe`'s.

`optimal_moves` is the perfect player's: every move that keeps the best reachable result by full minimax (memoised
over the 5,478 reachable positions), so a perfect player never loses and a random one rarely draws against it.
"""

from __future__ import annotations

import functools
import random
import re

from grpo_lightning.distributed import derive_seed
from grpo_lightning.games.base import StepResult, TwoPlayerGame
from grpo_lightning.games.registry import register_game

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
MARKS = ("X", "O")
CELL = re.compile(r"^\[\s*([0-8])\s*\]$")


def winner(board: str) -> int | None:
    """The seat with three in a line on `board` (9 characters of X, O and .), or None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return MARKS.index(board[a])
    return None


@functools.cache
def minimax_value(board: str, to_move: int) -> int:
    """The result for seat `to_move` under perfect play from `board`: +1 win, 0 draw, -1 loss."""
    won = winner(board)
    if won is not None:
        return 1 if won == to_move else -1
    if "." not in board:
        return 0
    return max(-minimax_value(_play(board, cell, to_move), 1 - to_move) for cell in _free(board))


def shuffled_moves(moves: list[str], seed: int, turn: int) -> tuple[list[str], str]:
    """`moves` in the order the game seeded `seed` lists them at `turn` (moves made so far), and the example move
    its prompt shows, drawn from the same generator (a stable hash of both: the same in every process and run)."""
    rng = random.Random(derive_seed("tictactoe_shuffled", seed, turn))
    order = list(moves)
    rng.shuffle(order)
    return order, rng.choice(order) if order else ""


def _free(board: str) -> list[int]:
    return [i for i, c in enumerate(board) if c == "."]


def _play(board: str, cell: int, seat: int) -> str:
    return board[:cell] + MARKS[seat] + board[cell + 1 :]


@register_game("tictactoe")
class TicTacToe(TwoPlayerGame):
    longest_game = 9
    enumerable = True  # 4,520 positions with a player to move (2,423 of X's, 2,097 of O's), the board all there is

    def __init__(self) -> None:
        self.board = "........."
        self.to_move = 0
        self._outcome: tuple[float, float] | None = None
        self.seed = 0

    def reset(self, seed: int) -> None:
        self.board, self.to_move, self._outcome, self.seed = ".........", 0, None, seed

    @property
    def current_player(self) -> int:
        return self.to_move

    @property
    def outcome(self) -> tuple[float, float] | None:
        return self._outcome

    def legal_moves(self) -> list[str]:
        return [f"[{i}]" for i in _free(self.board)]

    @property
    def solved(self) -> bool:
        return True

    def optimal_moves(self) -> list[str]:
        """The moves that keep the best result the player to move can force (the perfect player's choices)."""
        value = minimax_value(self.board, self.to_move)
        return [
            f"[{cell}]"
            for cell in _free(self.board)
            if -minimax_value(_play(self.board, cell, self.to_move), 1 - self.to_move) == value
        ]

    def winning_moves(self, player: int) -> list[str]:
        """The free cells that complete a line of `player`'s marks."""
        return [f"[{cell}]" for cell in _free(self.board) if winner(_play(self.board, cell, player)) == player]

    @property
    def lists_winning_moves(self) -> bool:
        return True

    def render(self) -> str:
        rows = []
        for r in range(3):
            cells = [self.board[3 * r + c] if self.board[3 * r + c] != "." else str(3 * r + c) for c in range(3)]
            rows.append(" " + " | ".join(cells))
        return "\n---+---+---\n".join(rows)

    def listed_moves(self) -> tuple[list[str], str]:
        """The legal moves as the prompt lists them, and the example move it shows: ascending, and `[4]`."""
        return self.legal_moves(), "[4]"

    def observation(self, player: int) -> str:
        order = "you move first" if player == 0 else "your opponent moved first"
        listed, example = self.listed_moves()
        return (
            f"You are playing Tic Tac Toe as {MARKS[player]} ({order}). Get three of your marks in a row, column "
            f"or diagonal to win. Numbers are free cells.\n\n{self.render()}\n\n"
            f"Legal moves: {', '.join(listed)}\n"
            f"Reply with your move as a cell number in square brackets, for example {example}."
        )

    def step(self, reply: str) -> StepResult:
        move = self.move_in(reply)
        seat = self.to_move
        cell = CELL.match(move) if move is not None else None
        if cell is None or self.board[int(cell.group(1))] != ".":
            self._outcome = (-1.0, 1.0) if seat == 0 else (1.0, -1.0)
            return StepResult(illegal=True, done=True, outcome=self._outcome)
        self.board = _play(self.board, int(cell.group(1)), seat)
        won = winner(self.board)
        if won is not None:
            self._outcome = (1.0, -1.0) if won == 0 else (-1.0, 1.0)
        elif "." not in self.board:
            self._outcome = (0.0, 0.0)
        self.to_move = 1 - seat
        return StepResult(illegal=False, done=self.done, outcome=self._outcome)


@register_game("tictactoe_shuffled")
class ShuffledTicTacToe(TicTacToe):
    """TicTacToe whose prompt lists the legal moves in the seeded order of its seed and turn (`shuffled_moves`)."""

    enumerable = False  # the prompt depends on the game's seed as well as on the board

    def listed_moves(self) -> tuple[list[str], str]:
        return shuffled_moves(self.legal_moves(), self.seed, 9 - self.board.count("."))
