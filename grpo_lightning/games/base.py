"""The two-player game interface every game source implements.

A game is a small state machine the self-play variant (variants/selfplay.py) drives in lockstep with many others:
reset it by seed, ask whose turn it is and what that player sees, step it with the text of a move. It knows
nothing of models, tokenizers or the trainer, and it never draws from a random state it does not own (Python's
`random`, numpy's and torch's global generators stay as they were): a game seeded alike plays alike, whatever
the trainer did before.

Game ids, and the factory that makes a game of one, are games/registry.py's.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

MOVE_PATTERN = re.compile(r"\[[^\[\]\n]{1,40}\]")
"""A move in a reply: text in square brackets, TextArena's convention (`[4]`, `[rock]`, `[take 2]`)."""


def bracketed_move(reply: str) -> str | None:
    """The first bracketed move in `reply` (`"I play [4] now"` -> `"[4]"`), or None when it has none."""
    found = MOVE_PATTERN.search(reply)
    return found.group(0) if found else None


@dataclass(frozen=True)
class StepResult:
    """What one move did."""

    illegal: bool
    """The move was not one of the legal moves (or not a move at all): with `illegal_move_loses` the mover lost."""
    done: bool
    outcome: tuple[float, float] | None = None
    """Once `done`: each seat's result, +1 win, 0 draw, -1 loss (seat 0 first); None while the game goes on."""


class TwoPlayerGame(ABC):
    """One game in progress between seat 0 and seat 1."""

    game_id: str = "unnamed"
    longest_game: int | None = None
    """The most moves (both players') a game can last, when the rules bound it (TicTacToe 9, Kuhn Poker 3); None:
    unbounded or unknown (self-play's `variant.max_turns` bounds it then). Sizes a self-play group's rollouts."""

    @abstractmethod
    def reset(self, seed: int) -> None:
        """Start a new game; the same seed gives the same game (deal, board, first mover)."""

    @property
    @abstractmethod
    def current_player(self) -> int:
        """The seat to move (0 or 1)."""

    @property
    @abstractmethod
    def outcome(self) -> tuple[float, float] | None:
        """Each seat's result once the game is over (+1 win, 0 draw, -1 loss; seat 0 first), else None."""

    @property
    def done(self) -> bool:
        """Over: a game has an outcome exactly when it is done."""
        return self.outcome is not None

    def check_not_done(self) -> None:
        """`step` on a finished game is a mistake of the caller's, not a move: raised, never scored."""
        if self.done:
            raise RuntimeError("the game is over; reset it")

    def move_in(self, reply: str) -> str | None:
        """The bracketed move of a reply to the current turn (None: it has none); a finished game refuses."""
        self.check_not_done()
        return bracketed_move(reply)

    payoff_unit: str | None = None
    """What `payoff` counts when it is more than the outcome (Kuhn Poker: `chips`); None: the outcome is the whole
    result, and the evaluation reports no payoff of its own."""

    @property
    def payoff(self) -> tuple[float, float] | None:
        """Each seat's payoff once the game is over, in `payoff_unit` (the chips won in poker: a call of a bet wins
        or loses 2, a fold 1); by default the outcome, for games whose result is all there is."""
        return self.outcome

    @abstractmethod
    def observation(self, player: int) -> str:
        """What `player` sees before moving: the rules, the state and how to answer (the user message)."""

    def droppable_messages(self, player: int) -> int:
        """How many messages of `observation(player)` are old history that a prompt too long for its token budget
        may leave out, oldest first (`shortened_observation`; data/games.py `TurnPrompts` cuts with them).

        0 by default: an observation that is the rules and the current state alone (the built-in TicTacToe's) has
        nothing to drop, and one too long for the budget is refused rather than sent without its rules.
        """
        return 0

    def shortened_observation(self, player: int, dropped: int) -> str:
        """`observation(player)` without its `dropped` oldest droppable messages (0 <= dropped <=
        `droppable_messages(player)`). What is never dropped: the rules, seat and move format at the start and the
        current state at the end, which the player needs at every move; old moves are summed up in that state."""
        if dropped != 0:
            raise ValueError(f"{self.game_id} has no history messages to leave out (asked for {dropped})")
        return self.observation(player)

    @abstractmethod
    def legal_moves(self) -> list[str]:
        """The moves the player to move may make, each as it is written in a reply (`[4]`)."""

    @abstractmethod
    def step(self, reply: str) -> StepResult:
        """Play the current player's reply (the model's whole text; the game finds the move in it)."""

    def optimal_moves(self) -> list[str]:
        """The moves perfect play allows now (the `perfect` scripted player's); a game that is not solved here
        cannot say, and the config check refuses `perfect` for it."""
        raise NotImplementedError(f"{self.game_id} has no perfect player")

    def optimal_distribution(self) -> dict[str, float]:
        """How perfect play mixes its moves now (the `perfect` player's draw): uniform over `optimal_moves` unless
        the game's equilibrium is a mixed one (Kuhn Poker's)."""
        moves = self.optimal_moves()
        return {move: 1.0 / len(moves) for move in moves}

    @property
    def solved(self) -> bool:
        """Whether `optimal_moves` is implemented (the `perfect` opponent can play this game)."""
        return False

    def winning_moves(self, player: int) -> list[str]:
        """The moves with which `player` would win at once if it were to move in this position (the `tactic`
        scripted player's: win, else block); a game that cannot say raises, and the config check refuses `tactic`
        for it."""
        raise NotImplementedError(f"{self.game_id} does not list winning moves")

    @property
    def lists_winning_moves(self) -> bool:
        """Whether `winning_moves` is implemented (the `tactic` opponent can play this game)."""
        return False

    responds_exactly: bool = False
    """Whether the game computes an exact best response to a policy's strategy (`strategy_positions`,
    `information_set`, `best_response`, `exploitability`; Kuhn Poker): `eval/exploitability` and self-play's
    `best_response` opponent read the policy at `strategy_positions` and answer it (games/policy_moves.py)."""

    def strategy_positions(self) -> list[TwoPlayerGame]:
        """One position at each information set of the game (`responds_exactly` games): where the policy's move
        distribution is read to make its whole strategy."""
        raise NotImplementedError(f"{self.game_id} has no exact best response")

    def information_set(self) -> Hashable:
        """What the player to move knows here (its hidden card and the moves so far): the key of a strategy."""
        raise NotImplementedError(f"{self.game_id} has no exact best response")

    def best_response(self, strategy: Mapping[Hashable, Mapping[str, float]]) -> dict[Hashable, dict[str, float]]:
        """A best response to `strategy` (each information set's move distribution, moves in the game's format,
        `[check]`), from both seats in one strategy: each seat's information sets answer `strategy` playing the
        other seat; uniform over the moves that are worth the same."""
        raise NotImplementedError(f"{self.game_id} has no exact best response")

    def exploitability(self, strategy: Mapping[Hashable, Mapping[str, float]]) -> float:
        """What a best response wins against `strategy`, in `payoff` units a game on the seats' mean (0 at an
        equilibrium)."""
        raise NotImplementedError(f"{self.game_id} has no exact best response")

    enumerable: bool = False
    """Whether a policy's exact results can be computed by reading its moves at every position it can reach
    (`eval.exact_opponents`, games/policy_moves.py): a few thousand positions at most, each wholly described by
    its rendering and the player to move (`exact.position_key`), and a prompt that depends on nothing else."""


TEXTARENA_PREFIX = "textarena:"
"""How a TextArena game id starts (`textarena:Nim-v0`; games/registry.py, games/textarena_games.py)."""
