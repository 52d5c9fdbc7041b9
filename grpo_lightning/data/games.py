"""Two-player games as a data source: `data=games data.dataset.game=<id>` (variant=selfplay; docs/selfplay.md).

A "problem" here is a game seed: round r's prompts are the seeds the prompt stream deals, and the self-play
variant plays `variant.games_per_group` games of each, all from the same seat against the same opponent (one
advantage group). The test split is `num_test` seeds from `eval_seed` on, disjoint from training's.

How a game's observation becomes a prompt is this source's: the system message, and `reply_prefix`, text put at
the start of the model's reply (`[` asks for a bracketed move). The prefix is part of the prompt the turn is
sampled from and trained on, so what the policy learns is exactly what it was asked. `TurnPrompts` fits a turn's
prompt into `data.max_prompt_tokens` by leaving out old history, never the rules or the current state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from grpo_lightning.data.source import DataSource, Problem
from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.registry import check_game_id, make_game
from grpo_lightning.rewards.base import AnswerChecker
from grpo_lightning.schema import check_settings, choice, integer, optional, setting, text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GameSeed:
    """The record of a game "problem": which game and which seed (`Prompt.record`)."""

    game_id: str
    seed: int


@dataclass
class GameSeeds(DataSource):
    """`data.dataset` for data=games: the game, the seeds of its training and test games, and the prompt."""

    gives_records: ClassVar[bool] = True
    """Each problem carries a `GameSeed`; each trained turn carries a `TurnRecord` (rewards/games.py)."""
    has_solutions: ClassVar[bool] = False
    """No reference solutions to score in a dry run: a game is won by playing it."""
    card_tags: ClassVar[tuple[str, ...]] = ("self-play",)

    game: str = setting("tictactoe", check_game_id)
    size: int = setting(1000, integer(1))
    seed: int = setting(0, integer(0))
    eval_seed: int = setting(1_000_000_000, integer(0))
    split: str = setting("train", choice("train", "test"))
    system_prompt: str | None = setting("You are playing a game. Answer with your move only.", optional(text))
    reply_prefix: str = setting("[", text)
    num_test: int = field(default=32, repr=False)
    """Test seeds (`test_split` sets eval.num_problems); not a config key."""

    def __post_init__(self) -> None:
        check_settings(self, "data.dataset")
        if self.eval_seed < self.seed + self.size:
            raise ValueError(
                f"data.dataset.eval_seed ({self.eval_seed}) must be >= data.dataset.seed + data.dataset.size "
                f"({self.seed + self.size}): test games would share seeds with training"
            )

    def describe(self) -> str:
        prefix = f", replies start with {self.reply_prefix!r}" if self.reply_prefix else ""
        if self.split == "train":
            return f"{self.game} games (train: seeds {self.seed}..{self.seed + self.size - 1}{prefix})"
        return f"{self.game} games (test: seeds {self.eval_seed}..{self.eval_seed + self.num_test - 1}{prefix})"

    def card_description(self) -> str:
        """The model card's words: the game and its training seeds."""
        return f"self-play games of `{self.game}` ({self.size} seeds; docs/selfplay.md)"

    def test_split(self, path: str | None = None, num_problems: int | None = None) -> GameSeeds:
        """`eval.dataset`: the same game and prompt, `num_problems` seeds from `eval_seed` (`path` is for files)."""
        return replace(self, split="test", num_test=num_problems or self.num_test)

    def checker(self, reward: Any = None) -> AnswerChecker:
        """Refused: a game is evaluated by playing it (training/game_evaluation.py), not by checking replies."""
        raise ValueError(
            "data=games is evaluated by playing (eval._target_: grpo_lightning.training.game_evaluation."
            "GameEvaluator, as experiment=selfplay_tictactoe sets), not by an answer checker"
        )

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one observation (the user message is what the game shows the player)."""
        if self.system_prompt:
            return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        return [{"role": "user", "content": question}]

    def load(self) -> list[Problem]:
        first, count = (self.seed, self.size) if self.split == "train" else (self.eval_seed, self.num_test)
        return [
            Problem(f"{self.game} seed {s}", solution="", answer="", record=GameSeed(self.game, s))
            for s in range(first, first + count)
        ]

    def check_prompts_fit(self, tokenizer, budgets: dict[str, int]) -> None:
        """The game's opening prompts, both seats, within each budget: the rules and the first state, which no cut
        may leave out (`TurnPrompts`)."""
        for key, limit in budgets.items():
            TurnPrompts(self, tokenizer, limit, key).check_opening()

    def encode(self, tokenizer, observation: str) -> list[int]:
        """The prompt ids of one observation: the chat template with the generation prompt, then `reply_prefix`."""
        chat = tokenizer.apply_chat_template(self.messages(observation), tokenize=False, add_generation_prompt=True)
        return tokenizer(chat + self.reply_prefix, add_special_tokens=False)["input_ids"]


class TurnPrompts:
    """The prompt ids of game turns within a token budget: `data.max_prompt_tokens` in self-play's rounds,
    `eval.max_prompt_tokens` in the game evaluation (`key` names it in messages).

    The rule. A prompt that fits is the source's encoding of the whole observation, unchanged. A longer one leaves
    out the observation's oldest history messages, as few as make it fit (`TwoPlayerGame.droppable_messages`,
    `shortened_observation`): the rules, the player's seat and the move format at its start and the current state at
    its end are always kept. A turn whose rules and current state alone exceed the budget is refused: a ValueError
    whose one line starts with the key.

    Why not keep the last tokens, as the other data sources do: a game's prompt grows with its history (TextArena's
    ConnectFour passes 512 tokens by its fifth move), and its last tokens lose the system message, the seat and the
    move format, which every move needs, while what old moves did is summed up in the current state. Why refuse
    rather than cut into the rules: a model asked to move without them learns from prompts that do not say the game.

    Each cut prompt is counted by the caller (`encode` says how many messages it left out; self-play logs
    `game/prompts_cut`), and the first cut of a run is logged once as a warning naming the key and the game.
    """

    def __init__(self, source: GameSeeds, tokenizer, max_prompt_tokens: int, key: str = "data.max_prompt_tokens",
                 metric: str | None = "game/prompts_cut") -> None:  # fmt: skip
        self.source, self.tokenizer, self.max_prompt_tokens, self.key = source, tokenizer, max_prompt_tokens, key
        self.metric = metric
        """Where the caller counts the cut prompts (named in the warning), None where they are not counted."""
        self.warned = False

    def encode(self, game: TwoPlayerGame, player: int) -> tuple[list[int], int]:
        """`player`'s prompt ids in `game`, and how many history messages they leave out (0: the whole observation).

        The fewest messages are found by bisection over the number left out (each try tokenises the prompt once):
        the prompt's length falls as messages go, and a game late in a long history has dozens of them.
        """
        ids = self.source.encode(self.tokenizer, game.observation(player))
        if len(ids) <= self.max_prompt_tokens:
            return ids, 0
        droppable = game.droppable_messages(player)
        shortest = self._ids(game, player, droppable)
        if len(shortest) > self.max_prompt_tokens:
            raise ValueError(self._refusal(game, player, len(shortest), droppable))
        fits, low, high = shortest, 1, droppable  # `high` messages left out always fit
        while low < high:
            middle = (low + high) // 2
            tried = self._ids(game, player, middle)
            if len(tried) <= self.max_prompt_tokens:
                fits, high = tried, middle
            else:
                low = middle + 1
        if not self.warned:
            self.warned = True
            counted = f"; counted in {self.metric}" if self.metric else ""
            log.warning(
                "%s=%d: prompts of %s grow with the game's history and are cut to fit: they leave out the oldest "
                "history messages and keep the rules and the current state (the first left out %d of %d messages, "
                "%d tokens before the cut%s); raise %s to keep more history",
                self.key, self.max_prompt_tokens, game.game_id, high, droppable, len(ids), counted, self.key,
            )  # fmt: skip
        return fits, high

    def check_opening(self, seed: int | None = None) -> None:
        """Refuse, before the first round, a game whose opening prompts (either seat, nothing played, so nothing to
        leave out) do not fit: what `encode` would refuse at the first move, said before anything is played."""
        game = make_game(self.source.game)
        game.reset(self.source.seed if seed is None else seed)
        for player in (0, 1):
            length = len(self.source.encode(self.tokenizer, game.observation(player)))
            if length > self.max_prompt_tokens:
                raise ValueError(self._refusal(game, player, length, 0))

    def _ids(self, game: TwoPlayerGame, player: int, dropped: int) -> list[int]:
        return self.source.encode(self.tokenizer, game.shortened_observation(player, dropped))

    def _refusal(self, game: TwoPlayerGame, player: int, length: int, dropped: int) -> str:
        history = f", {dropped} history messages left out" if dropped else ""
        return (
            f"{self.key} ({self.max_prompt_tokens}) cannot hold a prompt of {game.game_id}: its rules and current "
            f"state alone take {length} tokens (seat {player}, with the chat template, system prompt and reply "
            f"prefix{history}); raise {self.key} (and check the model's context) or choose a shorter game"
        )
