"""What every data source (`data.dataset`) is: a `DataSource`. Sources: GSM8K or any question/answer data set
(data/gsm8k.py, the default), reasoning-gym's procedural tasks (data/reasoning_gym.py) and two-player games
(data/games.py, variant=selfplay); docs/data.md, and docs/extending.md for a source of one's own.

Why an abstract class rather than a description in prose: the data module, the evaluator, the plan, the config
check and the model card each ask a source something, and a class that derives from `DataSource` is told by its
missing methods, when it is built, what it has not said; no caller asks a source whether it has an attribute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from grpo_lightning.rewards.base import AnswerChecker
from grpo_lightning.schema import configures, integer, optional, setting, text


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str
    """A reference solution that scores 1 (GSM8K: the full solution, ending with `#### <answer>`; generated
    tasks: the answer written in the asked format)."""
    answer: str
    """The reference answer (GSM8K: the text after the last `####`, commas removed)."""
    record: object = field(default=None, compare=False)
    """Opaque per-problem record for reward terms and the answer checker (`Prompt.record`); None for GSM8K."""


class DataSource(ABC):
    """`data.dataset`: where a run's problems come from and how a prompt asks one.

    A source is built from its config node (`_target_` and its keys; a settings dataclass declares them,
    grpo_lightning/schema.py). What each member is for, and who asks it:

    - `load()`: the problems (the data module, for training; the evaluator, on the test split);
    - `messages(question)`: the chat a problem's prompt is made of (the data module and the evaluator tokenise
      it with the model's chat template; the plan checks `data.max_prompt_tokens` leaves room for a question);
    - `describe()`: the source in a line (the plan, printed by every run);
    - `test_split(path, num_problems)`: the same source on its test split (`eval.dataset`);
    - `checker(reward)`: how evaluation judges a reply (`eval.checker: null`);
    - `card_description()`, `card_tags`: the training data in the exported model card;
    - `check_prompts_fit(tokenizer, budgets)`: prompts no budget can hold, refused before the first round;
    - `gives_records`, `has_solutions`: what its problems carry (the config check, the dry run).

    Why some members have defaults: a question/answer source has solutions and no records, cuts a long prompt to
    its last tokens and is described on the card as in the plan; a source that differs says so. The others are
    abstract: no default would be right for every source.
    """

    gives_records: ClassVar[bool] = False
    """Whether its problems carry a `record` (`Problem.record`, `info["record"]` of a reward term): a reward term
    that scores with one (`needs_record`) is refused by the config check on a source without."""
    has_solutions: ClassVar[bool] = True
    """Whether its problems have reference solutions a dry run can score against the reward (games: none; a game
    is won by playing it)."""
    card_tags: ClassVar[tuple[str, ...]] = ()
    """Tags of the exported model card's metadata that name the training data (none by default)."""

    @abstractmethod
    def load(self) -> list[Problem]:
        """The problems of this source's split; a problem it cannot read is a one-line error naming the key."""

    @abstractmethod
    def describe(self) -> str:
        """The source in a few words, for the plan."""

    @abstractmethod
    def messages(self, question: str) -> list[dict[str, str]]:
        """The chat messages of one problem's prompt (the model's chat template turns them into the prompt)."""

    @abstractmethod
    def test_split(self, path: str | None = None, num_problems: int | None = None) -> DataSource:
        """`eval.dataset`: this source with its test split; `path`: the test split's file where the source reads
        files, `num_problems`: the problems the evaluator asks (a generated split's size)."""

    @abstractmethod
    def checker(self, reward: Any = None) -> AnswerChecker:
        """How evaluation judges a reply (`eval.checker: null`); `reward`: `eval.reward`, for a source whose
        checker keeps a reward's own accuracy. A source evaluated otherwise (games are played) raises ValueError
        naming what to configure."""

    def card_description(self) -> str:
        """The training data in words, for the exported model card: `describe()` unless the source has better."""
        return self.describe()

    def check_prompts_fit(self, tokenizer, budgets: dict[str, int]) -> None:  # noqa: B027 - a no-op default
        """Raise ValueError, before the first round, when a prompt of this source can never fit a token budget
        (`budgets`: config key -> tokens; `tokenizer`: the policy's). No-op: a longer prompt keeps its last
        tokens (data/datamodule.py `encode_prompt`), so every prompt fits; a game's must keep its rules."""


@dataclass(frozen=True)
class TestSplitSettings:
    """`eval.dataset`: the training data's test split; its file or folder when the training data is local."""

    path: str | None = setting(None, optional(text))
    num_problems: int | None = setting(None, optional(integer(1)))


def test_split_of(train: DataSource, path: str | None = None, num_problems: int | None = None) -> DataSource:
    """`eval.dataset`: the training data (`data.dataset`) with its test split.

    Why a function of the training data: evaluation must ask the questions the way training does, so every key
    but the split (a local file's path, a generated source's count) is the training data's, stated once in
    `data.dataset`.
    """
    return train.test_split(path=path, num_problems=num_problems)


configures(test_split_of, TestSplitSettings)


def check_text_file(key: str, path: Path) -> None:
    if not path.exists():
        raise ValueError(f"{key}: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{key}: {path} is not a file (give a JSONL file)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path} ({err.strerror})") from None
    if data[:2] == b"\x1f\x8b":
        raise ValueError(f"{key}: {path} is gzip-compressed; decompress it first (gunzip -k {path.name})")
    bom = data[:2] in (b"\xff\xfe", b"\xfe\xff")
    ascii_utf16 = len(data) >= 4 and (data[1] == data[3] == 0 or data[0] == data[2] == 0) and b"\0\0" not in data[:4]
    if bom or ascii_utf16:
        raise ValueError(f"{key}: {path} is UTF-16 text; JSONL must be UTF-8 (iconv -f UTF-16 -t UTF-8)")
    if b"\0" in data[:65536]:
        raise ValueError(f"{key}: {path} is a binary file, not JSONL text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{key}: {path} is not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); save it as "
            "UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None
