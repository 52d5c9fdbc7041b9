"""Two-player text games for self-play (docs/selfplay.md): the interface, the built-in games, TextArena's."""

from grpo_lightning.games import kuhn_poker as _kuhn_poker  # noqa: F401 - registers the built-in games
from grpo_lightning.games import tictactoe as _tictactoe  # noqa: F401
from grpo_lightning.games.base import StepResult, TwoPlayerGame, bracketed_move
from grpo_lightning.games.registry import BUILTIN_GAMES, check_game_id, make_game, register_game

__all__ = [
    "BUILTIN_GAMES",
    "StepResult",
    "TwoPlayerGame",
    "bracketed_move",
    "check_game_id",
    "make_game",
    "register_game",
]
