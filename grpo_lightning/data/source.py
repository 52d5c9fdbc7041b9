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
from pathlib import Path

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
