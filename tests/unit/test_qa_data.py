"""data=gsm8k on question/answer data of one's own: each format (JSONL, Parquet, save_to_disk Dataset and
DatasetDict, a Hub id that is a local folder) written here with columns other than GSM8K's, read back against the
rows written; each answer extraction against hand-written strings; each mistake in one line naming its key; GSM8K's
defaults unchanged; docs/data.md's commands dry-run on the files they name. Offline: nothing leaves the machine."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import open_dict

from grpo_lightning.app.validation import validate
from grpo_lightning.data.gsm8k import GSM8K, parse_rows, reference_answer
from grpo_lightning.rewards.gsm8k import GSM8KReward
from tests.conftest import ROOT, make_cfg

datasets = pytest.importorskip("datasets")  # the `hub` extra; make install installs it

BOXED = [
    {"problem": "What is 2 + 3?", "solution": "2 + 3 = \\boxed{5}"},
    {"problem": "Half of 9?", "solution": "Nine halves: $\\boxed{4.5}$."},
    {"problem": "Twelve hundreds?", "solution": "\\boxed{3} is a guess; it is \\boxed{1,200}"},
]
BOXED_TRUTH = [("What is 2 + 3?", "5"), ("Half of 9?", "4.5"), ("Twelve hundreds?", "1200")]
BOXED_TEST = [{"problem": "What is 7 - 9?", "solution": "so \\boxed{-2}"}]
BOXED_TEST_TRUTH = [("What is 7 - 9?", "-2")]
NUMBERS = [{"q": "Six times seven?", "a": 42}, {"q": "Three minus ten?", "a": -7}, {"q": "Ten hundreds?", "a": 1000}]
NUMBERS_TRUTH = [("Six times seven?", "42"), ("Three minus ten?", "-7"), ("Ten hundreds?", "1000")]
NUMBERS_TEST = [{"q": "One plus one?", "a": 2}]
NUMBERS_TEST_TRUTH = [("One plus one?", "2")]
BOXED_KEYS = {"question_column": "problem", "answer_column": "solution", "answer_extraction": "boxed"}
NUMBER_KEYS = {"question_column": "q", "answer_column": "a", "answer_extraction": "number"}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and `datasets`' cache under tmp_path (it reads its settings at import: patched there too)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def read(source: GSM8K) -> list[tuple[str, str]]:
    return [(p.question, p.answer) for p in source.load()]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_disk(path, rows, test_rows=None):
    """A Dataset folder, or with `test_rows` a DatasetDict folder with train and test splits."""
    data = datasets.Dataset.from_list(rows)
    if test_rows is not None:
        data = datasets.DatasetDict({"train": data, "test": datasets.Dataset.from_list(test_rows)})
    data.save_to_disk(str(path))
    return path


def one_line_error(make, *words) -> str:
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


# ---- each format, read back against the rows written -----------------------------------------------------------
def test_a_jsonl_file_with_its_own_keys(tmp_path):
    rows = [{"q": "Six times seven?", "a": 42}, {"q": "Three minus ten?", "a": "-7"}, {"q": "Big?", "a": "1,000"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    assert read(GSM8K(source="path", path=str(path), **NUMBER_KEYS)) == [
        ("Six times seven?", "42"), ("Three minus ten?", "-7"), ("Big?", "1000")
    ]  # fmt: skip


def test_a_parquet_file(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", BOXED)
    assert read(GSM8K(source="path", path=str(path), **BOXED_KEYS)) == BOXED_TRUTH


def test_a_save_to_disk_dataset_folder_and_its_test_split_elsewhere(tmp_path):
    train = write_disk(tmp_path / "train_set", NUMBERS)
    test = write_disk(tmp_path / "test_set", NUMBERS_TEST)
    source = GSM8K(source="path", path=str(train), **NUMBER_KEYS)
    assert read(source) == NUMBERS_TRUTH
    assert read(source.test_split(path=str(test))) == NUMBERS_TEST_TRUTH


def test_a_save_to_disk_dataset_dict_folder_holds_both_splits(tmp_path):
    folder = write_disk(tmp_path / "qa_dict", BOXED, BOXED_TEST)
    source = GSM8K(source="path", path=str(folder), **BOXED_KEYS)
    assert read(source) == BOXED_TRUTH
    assert read(source.test_split()) == BOXED_TEST_TRUTH  # no eval.dataset.path: the folder's own test split
    assert read(GSM8K(source="path", path=str(folder), split="test", **BOXED_KEYS)) == BOXED_TEST_TRUTH


def test_a_hub_id_that_is_a_local_folder_of_data_files(tmp_path):
    folder = tmp_path / "hub_copy"
    write_parquet(folder / "train.parquet", BOXED)
    write_parquet(folder / "test.parquet", BOXED_TEST)
    source = GSM8K(source="hub", hub_id=str(folder), hub_config=None, **BOXED_KEYS)
    assert read(source) == BOXED_TRUTH
    assert read(source.test_split()) == BOXED_TEST_TRUTH


def test_every_solution_scores_one_with_the_default_reward(tmp_path):
    """The dry run's check: a problem's `solution` is a reply the GSM8K reward marks right."""
    reward = GSM8KReward()
    for extraction, rows, (question, answer) in [
        ("gsm8k", [{"x": "Q", "y": "so\n#### 1,450"}], ("Q", "1450")),
        ("number", [{"x": "Q", "y": 3.5}], ("Q", "3.5")),
        ("boxed", [{"x": "Q", "y": "\\boxed{12}"}], ("Q", "12")),
        ("last_number", [{"x": "Q", "y": "3 apples and 17 pears"}], ("Q", "17")),
    ]:
        [problem] = parse_rows(rows, "test", "x", "y", extraction)
        assert (problem.question, problem.answer) == (question, answer)
        assert reward.score_detailed(problem.solution, problem.answer).reward == 1.0, extraction


# ---- the answer extractions, by hand -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extraction", "value", "expected"),
    [
        ("gsm8k", "work\n#### 1,450", "1450"),
        ("gsm8k", "#### 3\nthen\n#### -4.5", "-4.5"),
        ("gsm8k", "no final line", None),
        ("gsm8k", "#### abc", None),
        ("number", 42, "42"),
        ("number", 2.5, "2.5"),
        ("number", " 1,000 ", "1000"),
        ("number", "-7", "-7"),
        ("number", "forty", None),
        ("number", True, None),
        ("number", None, None),
        ("boxed", "first \\boxed{3} then \\boxed{12}", "12"),
        ("boxed", "\\boxed{ -2.5 }", "-2.5"),
        ("boxed", "\\boxed{\\frac{1}{2}}", None),
        ("boxed", "no box", None),
        ("boxed", 5, None),
        ("last_number", "3 apples and 17 pears", "17"),
        ("last_number", "in all 1,234.", "1234"),
        ("last_number", "none here", None),
    ],
)
def test_answer_extraction(extraction, value, expected):
    assert reference_answer(value, extraction) == expected


def test_rows_without_a_usable_answer_are_skipped_and_counted(tmp_path, caplog):
    rows = [
        *BOXED,
        {"problem": "Which fraction?", "solution": "\\boxed{\\frac{1}{2}}"},
        {"problem": "", "solution": "1"},
    ]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with caplog.at_level(logging.WARNING):
        assert read(GSM8K(source="path", path=str(path), **BOXED_KEYS)) == BOXED_TRUTH
    assert "skipped 2 malformed rows in " in caplog.text
    assert "each needs a question in 'problem' and a \\boxed{<number>} in 'solution'" in caplog.text


# ---- one line naming the key ---------------------------------------------------------------------------------
def test_a_missing_file_or_an_unknown_suffix(tmp_path):
    one_line_error(
        lambda: GSM8K(source="path", path=str(tmp_path / "nope.parquet")).load(), "data.dataset.path: file not found"
    )
    csv = tmp_path / "train.csv"
    csv.write_text("q,a\n")
    one_line_error(
        lambda: GSM8K(source="path", path=str(csv)).load(), "data.dataset.path:", "no known data suffix (.csv)"
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    one_line_error(lambda: GSM8K(source="path", path=str(plain)).load(), "data.dataset.path:", "save_to_disk")


@pytest.mark.parametrize("kind", ["parquet", "disk", "hub"])
def test_a_missing_column_names_its_key_and_the_columns(tmp_path, kind):
    if kind == "parquet":
        where = str(write_parquet(tmp_path / "train.parquet", BOXED))
    elif kind == "disk":
        where = str(write_disk(tmp_path / "train_set", BOXED))
    else:
        where = str(tmp_path / "hub_copy")
        write_parquet(tmp_path / "hub_copy" / "train.parquet", BOXED)
    source = "hub" if kind == "hub" else "path"
    place = {"hub_id": where, "hub_config": None} if kind == "hub" else {"path": where}
    message = one_line_error(
        lambda: GSM8K(source=source, **place).load(), "data.dataset.question_column 'question' is not a column of"
    )
    assert message.endswith("; columns: problem, solution"), message
    one_line_error(
        lambda: GSM8K(source=source, **place, question_column="problem", answer_column="final").load(),
        "data.dataset.answer_column 'final' is not a column of",
    )


def test_a_jsonl_file_without_the_column_names_its_key(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", BOXED)
    one_line_error(
        lambda: GSM8K(source="path", path=str(path)).load(),
        "no usable GSM8K rows",
        "data.dataset.question_column 'question' is in none of its rows; keys: problem, solution",
    )  # fmt: skip


def test_a_dataset_dict_without_the_split(tmp_path):
    folder = write_disk(tmp_path / "qa_dict", BOXED, BOXED_TEST)
    # a folder with only a train split
    only_train = tmp_path / "only_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(BOXED)}).save_to_disk(str(only_train))
    one_line_error(
        lambda: GSM8K(source="path", path=str(only_train), split="test", **BOXED_KEYS).load(),
        "data.dataset.split 'test' is not a split of", "splits: train",
    )  # fmt: skip
    assert read(GSM8K(source="path", path=str(folder), **BOXED_KEYS)) == BOXED_TRUTH


def test_no_usable_rows(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [{"problem": "Which?", "solution": "\\boxed{x}"}])
    one_line_error(
        lambda: GSM8K(source="path", path=str(path), **BOXED_KEYS).load(),
        "data.dataset: no usable question/answer rows", "data.dataset.answer_extraction=boxed",
    )  # fmt: skip


def test_a_single_split_source_needs_the_test_split_named(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", BOXED)
    one_line_error(lambda: GSM8K(source="path", path=str(path)).test_split(), "eval.dataset.path must be set")


def test_an_unknown_hub_id_offline(tmp_path):
    one_line_error(
        lambda: GSM8K(source="hub", hub_id="nobody-here/no-such-dataset", hub_config=None).load(),
        "data.dataset.hub_id 'nobody-here/no-such-dataset': cannot load split 'train'",
    )


def test_a_bad_key_value_names_the_key():
    one_line_error(lambda: GSM8K(answer_extraction="last"), "data.dataset.answer_extraction must be one of")
    one_line_error(lambda: GSM8K(question_column=3), "data.dataset.question_column must be a string")


@pytest.mark.parametrize(
    ("make", "overrides", "words"),
    [
        (None, ["data.dataset.path=my_data/train.csv", "eval.enabled=false"], ["data.dataset.path:", "(.csv)"]),
        (None, ["data.dataset.path=my_data/none.parquet", "eval.enabled=false"], ["data.dataset.path: file not"]),
        ("only_train", ["data.dataset.path=my_data/qa", "data.dataset.split=test"], ["data.dataset.split 'test'"]),
        ("only_train", ["data.dataset.path=my_data/qa"], ["eval.dataset.path: ", "has no 'test' split"]),
        ("set", ["data.dataset.path=my_data/qa"], ["eval.dataset.path must be set"]),
    ],
    ids=["unknown suffix", "not found", "no such split", "no test split", "one split needs eval.dataset.path"],
)
def test_the_config_check_refuses_before_loading(tmp_path, monkeypatch, make, overrides, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_data").mkdir()
    (tmp_path / "my_data" / "train.csv").write_text("q,a\n")
    if make == "only_train":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(BOXED)}).save_to_disk("my_data/qa")
    elif make == "set":
        write_disk(tmp_path / "my_data" / "qa", BOXED)
    cfg = make_cfg(tmp_path / "run", ["data.dataset.source=path", *overrides])
    one_line_error(lambda: validate(cfg), *words)


# ---- GSM8K unchanged ---------------------------------------------------------------------------------------------
def test_gsm8k_defaults_are_unchanged(monkeypatch):
    source = GSM8K()
    assert (source.source, source.hub_id, source.hub_config) == ("packaged", "openai/gsm8k", "main")
    assert (source.question_column, source.answer_column, source.answer_extraction) == ("question", "answer", "gsm8k")
    [problem] = parse_rows([{"question": " Q? ", "answer": "steps\n#### 1,000"}], origin="test")
    assert (problem.question, problem.solution, problem.answer) == ("Q?", "steps\n#### 1,000", "1000")
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"question": "Q?", "answer": "#### 3", "extra": 1}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert read(GSM8K(source="hub")) == [("Q?", "3")]
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]


# ---- the config and docs/data.md's commands ----------------------------------------------------------------------
def dry_run(output_dir, args: list[str]) -> float:
    from grpo_lightning.app.train import train

    cfg = make_cfg(output_dir, args)
    with open_dict(cfg):
        cfg.dry_run = True
    return train(cfg)["dry_run/reference_reward_mean"]


def write_documented_data(root):
    """The files docs/data.md's commands name, under `root`: each format, with the page's columns."""
    data = root / "my_data"
    write_jsonl(data / "train.jsonl", NUMBERS)
    write_jsonl(data / "test.jsonl", NUMBERS_TEST)
    write_parquet(data / "train.parquet", BOXED)
    write_parquet(data / "test.parquet", BOXED_TEST)
    write_disk(data / "qa_dict", BOXED, BOXED_TEST)
    write_disk(data / "train_set", NUMBERS)
    write_disk(data / "test_set", NUMBERS_TEST)
    write_parquet(data / "hub_copy" / "train.parquet", BOXED)
    write_parquet(data / "hub_copy" / "test.parquet", BOXED_TEST)
    return {"<hub-id>": str(data / "hub_copy")}


def test_a_parquet_file_composes_and_dry_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_documented_data(tmp_path)
    args = [
        "data.dataset.source=path", "data.dataset.path=my_data/train.parquet", "eval.dataset.path=my_data/test.parquet",
        "data.dataset.question_column=problem", "data.dataset.answer_column=solution",
        "data.dataset.answer_extraction=boxed",
    ]  # fmt: skip
    cfg = make_cfg(tmp_path / "cfg", args)
    assert (cfg.data.dataset.question_column, cfg.data.dataset.answer_extraction) == ("problem", "boxed")
    assert dry_run(tmp_path / "run", args) == pytest.approx(1.0)
    assert "my_data/train.parquet" in capsys.readouterr().out


def test_the_commands_of_docs_data_md_for_own_data_dry_run(tmp_path, monkeypatch, capsys):
    from tests.test_docs import command_args, read_markdown

    monkeypatch.chdir(tmp_path)
    placeholders = write_documented_data(tmp_path)
    commands = [c for c in read_markdown(ROOT / "docs" / "data.md").commands if "data.dataset.source=" in c[1]]
    assert len(commands) >= 5, commands
    sources = set()
    for number, (line, command) in enumerate(commands):
        for placeholder, value in placeholders.items():
            command = command.replace(placeholder, value)
        args = command_args(command)
        sources.add(next(a for a in args if a.startswith("data.dataset.source=")))
        try:
            assert dry_run(tmp_path / f"run{number}", args) == pytest.approx(1.0)
        except Exception as err:
            raise AssertionError(f"docs/data.md:{line}: {command}\n{type(err).__name__}: {err}") from err
    assert sources == {"data.dataset.source=path", "data.dataset.source=hub"}
    capsys.readouterr()
