"""The game ids, the rule that checks one and the factory that makes its game.

Game ids: the built-in games by name (`tictactoe`, games/tictactoe.py, no third-party package), and TextArena's
two-player games as `textarena:<EnvId>` (games/textarena_games.py; the `games` extra). `check_game_id` says in one
line why an id cannot run here before anything loads (docs/selfplay.md lists which run offline).
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_lightning.games.base import TEXTARENA_PREFIX, TwoPlayerGame

GameFactory = Callable[[], TwoPlayerGame]
BUILTIN_GAMES: dict[str, GameFactory] = {}


def register_game(name: str):
    """Class decorator: a built-in game, made by `make_game(name)` (docs/selfplay.md, "Adding a game")."""

    def decorator(cls):
        if name in BUILTIN_GAMES:
            raise ValueError(f"game id {name!r} is already registered")
        cls.game_id = name
        BUILTIN_GAMES[name] = cls
        return cls

    return decorator


def check_game_id(game_id) -> str | None:
    """A rule (schema.py): what a game id must be, or None when it names a game that runs here (the caller adds
    the key and the value to the message)."""
    if not isinstance(game_id, str):
        return "must be a game id such as tictactoe or textarena:Nim-v0"
    if game_id.startswith(TEXTARENA_PREFIX):
        from grpo_lightning.games.textarena_games import textarena_problem

        return textarena_problem(game_id[len(TEXTARENA_PREFIX) :])
    if game_id not in BUILTIN_GAMES:
        known = ", ".join(sorted(BUILTIN_GAMES))
        return f"must be a built-in game ({known}) or textarena:<EnvId>"
    return None


def make_game(game_id: str) -> TwoPlayerGame:
    """A new game of `game_id` (check it with `check_game_id` first; this raises ValueError naming the problem)."""
    problem = check_game_id(game_id)
    if problem is not None:
        raise ValueError(f"game id {problem} (got {game_id!r})")
    if game_id.startswith(TEXTARENA_PREFIX):
        from grpo_lightning.games.textarena_games import TextArenaGame

        return TextArenaGame(game_id[len(TEXTARENA_PREFIX) :])
    return BUILTIN_GAMES[game_id]()


def builtin_games_where(test: Callable[[TwoPlayerGame], bool]) -> list[str]:
    """The built-in game ids whose game passes `test` (what a message lists: "solved games only (...)")."""
    return sorted(name for name, factory in BUILTIN_GAMES.items() if test(factory()))
