"""TextArena's two-player games (`textarena:<EnvId>`, the `games` extra) behind the TwoPlayerGame interface.

Which ids run here is decided from a table, not by making the environment: `textarena_problem` is a config rule
(check_game_id, schema.py) and must answer at once, without network, before anything loads. The table,
textarena_games.json beside this module (read once, at import), comes from benchmarks/textarena_survey.py, which
makes, resets and steps every id textarena 0.7.4 registers, one game at a time in a subprocess with the network
blocked; rerun it with `--write` after changing the pinned release. An id is playable when it takes two players
and runs offline on Python 3.11: several games fetch nltk word lists at import, ask an OpenRouter model to judge or
to host, use Python 3.12 syntax, or need files the wheel does not ship. Python 3.12 is not surveyed: the games
that need it are refused there too.

`TextArenaGame` wraps one `textarena.make(env_id)`:

- Randomness. textarena's `State.__init__` calls `random.seed(seed)` on Python's global generator and the games
  draw from it (KuhnPoker shuffles its deck with `random.shuffle`). The game owns its own Python and numpy
  generator states: every call into textarena swaps them in and the caller's back out (`_own_random_state`), so
  the trainer's `random`, numpy and torch streams never move, and a game's draws depend only on its seed.
- Each `reset` makes a new environment: some keep state across resets (KuhnPoker shuffles the deck it shuffled
  last game), which would make a game depend on the games before it.
- Illegal moves lose. The state's `error_allowance` is set to 0, so the games that take it end an invalid move as
  a loss for the mover; for the others (which give a retry, or play a default move) the game ends here with the
  same result. An invalid move is whatever the game passes to its state's `set_invalid_move`: Snake and Surround
  kill the player of a bad move themselves (the game ends, the move is not counted as illegal), and
  IteratedPrisonersDilemma reads any reply without `[Defect]` as cooperating.
- The reply goes to `env.step` unchanged; textarena's own action wrapper puts brackets round a reply that has
  none (`hello` becomes `[hello]`, still illegal).
- Legal moves: textarena has no uniform API for them. `legal_moves` reads them from the state for the games in
  `LEGAL_MOVES` (TicTacToe, Nim, KuhnPoker, ConnectFour, IteratedRockPaperScissors, IteratedMatchingPennies and
  their variants) and returns [] for the rest: a scripted random player cannot play those.
- Long prompts. textarena's observation is the whole game so far, so it grows every move (ConnectFour's passes 512
  tokens by the fifth move). `droppable_indices` says which messages a prompt too long for its budget may leave
  out (the history between the rules and the current state), and `shortened_observation` renders the rest with
  the game's own observation wrapper (data/games.py `TurnPrompts` decides how many to leave out).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from grpo_lightning.games.base import TEXTARENA_PREFIX, StepResult, TwoPlayerGame

_TABLE = json.loads(importlib.resources.files(__package__).joinpath("textarena_games.json").read_text("utf-8"))
"""The survey's table (textarena_games.json, written by `python benchmarks/textarena_survey.py --write`)."""
TEXTARENA_VERSION: str = _TABLE["textarena"]
"""The release the table was surveyed on (the `games` extra pins it)."""
OFFLINE_TWO_PLAYER: frozenset[str] = frozenset(_TABLE["offline_two_player"])
"""The ids that take two players and run offline here."""
NOT_HERE: dict[str, str] = dict(_TABLE["not_here"])
"""Every other id textarena registers -> why it does not run here (the message puts it after `textarena:<id>`)."""


def textarena_problem(env_id: Any) -> str | None:
    """A rule: None when `env_id` names a two-player TextArena game that runs offline here, else what it must be
    (the caller adds the key and the value)."""
    if not isinstance(env_id, str):
        return "must be a TextArena env id such as Nim-v0"
    if importlib.util.find_spec("textarena") is None:
        return "needs textarena: pip install -e '.[games]' (make install does)"
    installed = importlib.metadata.version("textarena")
    if installed != TEXTARENA_VERSION:
        return (
            f"needs textarena=={TEXTARENA_VERSION}, the release whose games were surveyed ({installed} is installed): "
            "pip install -e '.[games]'"
        )
    if env_id in OFFLINE_TWO_PLAYER:
        return None
    if env_id in NOT_HERE:
        return (
            "must be a two-player TextArena game that runs offline (docs/selfplay.md); "
            f"textarena:{env_id} {NOT_HERE[env_id]}"
        )
    close = difflib.get_close_matches(env_id, sorted(OFFLINE_TWO_PLAYER), n=3)  # only games that run here
    if close:
        return f"must be a TextArena env id; close: {', '.join(close)}"
    return "must be a TextArena env id (docs/selfplay.md lists them)"


def _tictactoe_moves(state) -> list[str]:
    board = state.game_state["board"]
    return [f"[{3 * r + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]


def _nim_moves(state) -> list[str]:
    piles = state.game_state["piles"]
    return [f"[{pile} {take}]" for pile, size in enumerate(piles) for take in range(1, size + 1)]


def _kuhn_poker_moves(state) -> list[str]:
    tree = state.game_state["current_legal_action_tree"]
    return [f"[{action}]" for action in tree] if isinstance(tree, dict) else []


def _connect_four_moves(state) -> list[str]:
    top_row = state.game_state["board"][0]
    return [f"[{col}]" for col, cell in enumerate(top_row) if cell == "."]


def _rock_paper_scissors_moves(state) -> list[str]:
    return ["[rock]", "[paper]", "[scissors]"]


def _matching_pennies_moves(state) -> list[str]:
    return ["[heads]", "[tails]"]


LEGAL_MOVES: dict[str, Callable[[Any], list[str]]] = {
    "TicTacToeEnv": _tictactoe_moves,
    "NimEnv": _nim_moves,
    "KuhnPokerEnv": _kuhn_poker_moves,
    "ConnectFourEnv": _connect_four_moves,
    "IteratedRockPaperScissorsEnv": _rock_paper_scissors_moves,
    "IteratedMatchingPenniesEnv": _matching_pennies_moves,
}
"""The unwrapped environment's class name -> the legal moves from its state, written as a reply (`[4]`, `[0 3]`)."""


def _render_messages(messages: list[tuple], role_mapping: dict[int, str]) -> str:
    """textarena's (sender, message, type) tuples as one text, one `[sender] message` line each (its LLM style)."""
    lines = []
    for sender, message, *_ in messages:
        name = "GAME" if sender == -1 else role_mapping.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


def _kind(message: tuple) -> str | None:
    """The name of a message's textarena ObservationType (`PROMPT`, `GAME_BOARD`, ...), None when it has none."""
    return getattr(message[2], "name", None) if len(message) > 2 else None


def droppable_indices(messages: list[tuple], player: int) -> list[int]:
    """The indices, oldest first, of the messages in `player`'s list that a prompt too long for its budget may
    leave out: the history between the head and the current state.

    - The head is kept: the first message and the `PROMPT` messages right after it (textarena's rules, the
      player's seat and symbol, the move format).
    - The current state is kept: every message after the player's own last move (the opponent's reply, the board
      or the round the game showed since). Why not only the last board: some games say what the board does not
      after the player's move (KuhnPoker deals a round's card in a message of its own), and what happened since
      the player last moved is what its next move answers. A player who has not moved yet has no history.
    - The latest `GAME_BOARD` message is kept wherever it is: the wrappers that show only the current board
      (`-train` ids) need one.
    """
    head = 1
    while head < len(messages) and _kind(messages[head]) == "PROMPT":
        head += 1
    own_moves = [i for i, m in enumerate(messages) if m[0] == player and _kind(m) == "PLAYER_ACTION"]
    state = own_moves[-1] + 1 if own_moves else head
    boards = [i for i, m in enumerate(messages) if _kind(m) == "GAME_BOARD"]
    last_board = boards[-1] if boards else None
    return [i for i in range(head, state) if i != last_board]


class TextArenaGame(TwoPlayerGame):
    """One game of a TextArena environment between seat 0 (textarena's Player 0) and seat 1 (Player 1)."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id
        self.game_id = TEXTARENA_PREFIX + env_id
        self.env: Any = None
        self._py_state = random.Random(0).getstate()
        self._np_state = np.random.RandomState(0).get_state()
        self._outcome: tuple[float, float] | None = None
        self._seen: dict[int, str] = {}
        self._history: dict[int, list[tuple]] = {0: [], 1: []}
        self._flagged: set[int] = set()
        self._hooked: Any = None
        self._raw = False
        """The id has no observation wrapper (`-raw`): its messages are kept and put together here."""
        self.reset(0)

    @contextlib.contextmanager
    def _own_random_state(self) -> Iterator[None]:
        """Run textarena on this game's Python and numpy generator states, then put the caller's back exactly.

        Not thread-safe (the global generators are swapped): drive a game from one thread at a time.
        """
        caller_py, caller_np = random.getstate(), np.random.get_state()
        random.setstate(self._py_state)
        np.random.set_state(self._np_state)
        try:
            yield
        finally:
            self._py_state, self._np_state = random.getstate(), np.random.get_state()
            random.setstate(caller_py)
            np.random.set_state(caller_np)

    def reset(self, seed: int) -> None:
        self._py_state = random.Random(seed).getstate()
        self._np_state = np.random.RandomState(seed % 2**32).get_state()
        with self._own_random_state():
            import textarena

            self.env = textarena.make(self.env_id)
            self.env.reset(num_players=2, seed=seed)
        self._outcome = None
        self._seen, self._history = {}, {0: [], 1: []}
        self._hook_state()

    @property
    def state(self) -> Any:
        """textarena's State of the game in progress (wrappers pass attribute reads through to the environment)."""
        return self.env.state

    def _hook_state(self) -> None:
        """Set the error allowance to 0 and note which seat the game flags an invalid move for.

        textarena keeps no per-step record of an invalid move that every State class agrees on
        (`made_invalid_move` is cleared by the next `State.step`, `game_info[...]["invalid_move"]` is set only when
        the allowance is spent), so the state's `set_invalid_move` is wrapped to note the seat to move.
        """
        state = self.state
        if state is self._hooked:
            return
        if hasattr(state, "error_allowance"):
            state.error_allowance = 0
        flag_invalid = state.set_invalid_move

        def set_invalid_move(*args, **kwargs):
            self._flagged.add(state.current_player_id)
            return flag_invalid(*args, **kwargs)

        state.set_invalid_move = set_invalid_move
        self._hooked = state

    @property
    def current_player(self) -> int:
        return int(self.state.current_player_id)

    @property
    def outcome(self) -> tuple[float, float] | None:
        return self._outcome

    def unwrapped(self) -> Any:
        """The environment under textarena's observation and action wrappers."""
        from textarena import Wrapper

        env = self.env
        while isinstance(env, Wrapper):
            env = env.env
        return env

    def legal_moves(self) -> list[str]:
        """The legal moves where `LEGAL_MOVES` knows the game, else [] (unknown: the random player cannot play it)."""
        moves = LEGAL_MOVES.get(type(self.unwrapped()).__name__)
        if moves is None or self.done:
            return []
        return moves(self.state)

    def observation(self, player: int) -> str:
        """What textarena shows `player` now, as one text (its observation wrapper's, where the id has one).

        textarena hands out a player's new messages once (`get_observation` drains them) and only to the player to
        move; the text is kept until the next step, and another seat's view is drained by making it the player to
        move for that one call.
        """
        if player not in self._seen:
            state = self.state
            to_move = state.current_player_id
            with self._own_random_state():
                state.current_player_id = player
                try:
                    _, observation = self.env.get_observation()
                finally:
                    state.current_player_id = to_move
            self._raw = not isinstance(observation, str)
            if not self._raw:
                self._seen[player] = observation.strip()
            else:  # no observation wrapper (the `-raw` ids): the new messages only, so keep the history here
                self._history[player].extend(observation or [])
                self._seen[player] = _render_messages(self._history[player], state.role_mapping).strip()
        return self._seen[player]

    def droppable_messages(self, player: int) -> int:
        """The history messages of `player`'s observation a long prompt may leave out (`droppable_indices`)."""
        messages, _ = self._messages(player)
        return len(droppable_indices(messages, player))

    def shortened_observation(self, player: int, dropped: int) -> str:
        """The observation rendered by the game's own observation wrapper (or, for `-raw` ids, as `observation`
        puts them together) from `player`'s messages less the `dropped` oldest droppable ones: the text keeps the
        format the game gives it, and with nothing dropped it is `observation(player)`."""
        messages, render = self._messages(player)
        droppable = droppable_indices(messages, player)
        if not 0 <= dropped <= len(droppable):
            raise ValueError(f"{self.game_id}: {dropped} messages asked to leave out, {len(droppable)} droppable")
        if dropped == 0:
            return self.observation(player)
        left_out = set(droppable[:dropped])
        return render([m for i, m in enumerate(messages) if i not in left_out])

    def _messages(self, player: int) -> tuple[list[tuple], Callable[[list[tuple]], str]]:
        """`player`'s (sender, message, type) messages so far, and how the game renders a list of them as the
        observation's text. Ids whose observation wrapper keeps no message list have none (nothing to drop)."""
        self.observation(player)  # the player's new messages join its list
        if self._raw:
            role_mapping = self.state.role_mapping
            return list(self._history[player]), lambda kept: _render_messages(kept, role_mapping).strip()
        env = self.env
        while not (hasattr(env, "full_observations") and hasattr(env, "_convert_obs_to_str")):
            env = getattr(env, "env", None)
            if env is None:
                return [], lambda kept: self.observation(player)
        wrapper = env

        def render(kept: list[tuple]) -> str:  # the wrapper's own rendering of `kept`, its list put back after
            full = wrapper.full_observations
            own = full[player]
            full[player] = kept
            try:
                return str(wrapper._convert_obs_to_str(player_id=player)).strip()
            finally:
                full[player] = own

        return list(wrapper.full_observations.get(player, [])), render

    def step(self, reply: str) -> StepResult:
        self.check_not_done()
        mover = self.current_player
        self._hook_state()
        self._flagged.clear()
        with self._own_random_state():
            self.env.step(reply)
        self._seen.clear()
        state = self.state
        illegal = mover in self._flagged or bool(state.game_info.get(mover, {}).get("invalid_move"))
        if illegal:
            self._outcome = (-1.0, 1.0) if mover == 0 else (1.0, -1.0)
        elif state.done:
            self._outcome = self._final_outcome()
        if self.done:
            with self._own_random_state():
                self.env.close()
        else:
            self._hook_state()
        return StepResult(illegal=illegal, done=self.done, outcome=self._outcome)

    def _final_outcome(self) -> tuple[float, float]:
        """Each seat's result from textarena's rewards: the seat with the larger reward won; equal rewards draw.

        Two-player games give +1 / -1 or 0 / 0, a few give scores; comparing the seats reads both alike.
        """
        rewards = self.state.rewards or {}
        first, second = float(rewards.get(0, 0.0)), float(rewards.get(1, 0.0))
        if first == second:
            return (0.0, 0.0)
        return (1.0, -1.0) if first > second else (-1.0, 1.0)
