"""Two-player games as a data source: `data=games data.dataset.game=<id>` (variant=selfplay; docs/selfplay.md).

A "problem" here is a game seed: round r's prompts are the seeds the prompt stream deals, and the self-play
variant plays `variant.games_per_group` games of each, all from the same seat against the same opponent (one
advantage group). The test split is `num_test` seeds from `eval_seed` on, disjoint from training's.

How a game's observation becomes a prompt is this source's: the system message, and `reply_prefix`, text put at
the start of the model's reply (`[` asks for a bracketed move). The prefix is part of the prompt the turn is
sampled from and trained on, so what the policy learns is exactly what it was asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from grpo_lightning.data.source import Problem
from grpo_lightning.games.base import check_game_id
from grpo_lightning.schema import check_settings, choice, integer, optional, setting, text


@dataclass(frozen=True)
class GameSeed:
    """The record of a game "problem": which game and which seed (`Prompt.record`)."""

    game_id: str
    seed: int


@dataclass
class GameSeeds:
    """`data.dataset` for data=games: the game, the seeds of its training and test games, and the prompt."""

    gives_records: ClassVar[bool] = True
    """Each problem carries a `GameSeed`; each trained turn carries a `TurnRecord` (rewards/games.py)."""
    has_solutions: ClassVar[bool] = False
    """No reference solutions to score in a dry run: a game is won by playing it."""

    game: str = setting("tictactoe", check_game_id, "tictactoe (built in) or textarena:<EnvId> (the games extra)")
    size: int = setting(1000, integer(1), "training game seeds: 0 .. size - 1 after `seed`")
    seed: int = setting(0, integer(0), "the first training game seed")
    eval_seed: int = setting(1_000_000_000, integer(0), "the first test game seed; must be >= seed + size (disjoint)")
    split: str = setting("train", choice("train", "test"), "train | test (eval.dataset makes the test split)")
    system_prompt: str | None = setting(
        "You are playing a game. Answer with your move only.", optional(text), "the chat's system message"
    )
    reply_prefix: str = setting(
        "[", text, "text that starts the model's reply, part of the prompt it trains on ('' for none)"
    )
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

    def test_split(self, path: str | None = None, num_problems: int | None = None) -> GameSeeds:
        """`eval.dataset`: the same game and prompt, `num_problems` seeds from `eval_seed` (`path` is for files)."""
        return replace(self, split="test", num_test=num_problems or self.num_test)

    def checker(self, reward: Any = None):
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

    def encode(self, tokenizer, observation: str) -> list[int]:
        """The prompt ids of one observation: the chat template with the generation prompt, then `reply_prefix`."""
        chat = tokenizer.apply_chat_template(self.messages(observation), tokenize=False, add_generation_prompt=True)
        return tokenizer(chat + self.reply_prefix, add_special_tokens=False)["input_ids"]
