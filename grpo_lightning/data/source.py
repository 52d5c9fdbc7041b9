"""What every data source (`data.dataset`) gives: problems, the chat messages of a prompt, its test split and the
answer checker its evaluation uses. Sources: GSM8K or any question/answer data set (data/gsm8k.py, the default),
reasoning-gym's procedural tasks (data/reasoning_gym.py) and two-player games (data/games.py, variant=selfplay);
docs/data.md.

A source is a settings dataclass with:

- `load() -> list[Problem]` and `describe() -> str`;
- `messages(question) -> list[dict]`, the chat the model's template turns into the prompt;
- `test_split(path, num_problems)`, the same source with its test split (`eval.dataset`);
- `checker(reward) -> AnswerChecker`, how evaluation judges a reply (`eval.checker: null`);
- the class attribute `gives_records`: whether its problems carry a `record` for reward terms that need one;
- the class attribute `has_solutions`: whether its problems have reference solutions a dry run can score (games:
  no).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class TestSplitSettings:
    """`eval.dataset`: the training data's test split; its file or folder when the training data is local."""

    path: str | None = setting(None, optional(text))
    num_problems: int | None = setting(None, optional(integer(1)))


def test_split_of(train, path: str | None = None, num_problems: int | None = None):
    """`eval.dataset`: the training data (`data.dataset`) with its test split.

    Why a function of the training data: evaluation must ask the questions the way training does, so every key
    but the split (a local file's path, a generated source's count) is the training data's, stated once in
    `data.dataset`.
    """
    return train.test_split(path=path, num_problems=num_problems)


configures(test_split_of, TestSplitSettings)
