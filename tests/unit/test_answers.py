"""Answer extraction per format, and the answer checkers evaluation uses, on hand-written replies."""

from __future__ import annotations

import pytest

from grpo_lightning.rewards.answers import (
    FORMATS,
    extract_answer,
    extract_any,
    format_answer,
    is_numeric,
    last_number,
)
from grpo_lightning.rewards.base import Verdict
from grpo_lightning.rewards.checkers import GSM8KChecker, NumericChecker
from grpo_lightning.rewards.reasoning_gym import ReasoningGymChecker, TaskRecord, format_free_answer

# (reply, format, what the format's strict reading finds)
CASES = [
    ("<answer>42</answer>", "tag", "42"),
    ("I add 40 and 2.\n<answer> 42 </answer>", "tag", "42"),
    ("<answer>1</answer> no wait <answer>2</answer>", "tag", "2"),  # the last one
    ("<answer>\n-7\n</answer>", "tag", "-7"),  # spans lines
    ("<answer>42", "tag", None),  # never closed
    ("<answer></answer>", "tag", None),  # empty
    ("#### 42", "tag", None),  # another format
    ("#### 42", "hash", "42"),
    ("So 6 x 7 = 42.\n####42\n", "hash", "42"),
    ("#### 1\nthen\n#### 3 apples", "hash", "3 apples"),  # the rest of the last #### line
    ("####", "hash", None),
    ("\\boxed{42}", "boxed", "42"),
    ("so \\boxed{\\frac{1}{2}} is it", "boxed", "\\frac{1}{2}"),  # nested braces kept
    ("\\boxed{1} and \\boxed{2", "boxed", "1"),  # the last one does not close: the one before
    ("\\boxed{ 7 }.", "boxed", "7"),
    ("boxed 42", "boxed", None),
    ("  42 \n", "plain", "42"),
    ("The answer is 42.", "plain", "The answer is 42."),
    ("   ", "plain", None),
]


@pytest.mark.parametrize(("reply", "answer_format", "expected"), CASES)
def test_each_format_reads_only_its_own_marker(reply, answer_format, expected):
    assert extract_answer(reply, answer_format) == expected


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="answer format must be one of tag, hash, boxed, plain"):
        extract_answer("x", "xml")


@pytest.mark.parametrize("answer_format", FORMATS)
@pytest.mark.parametrize("answer", ["7", "-12", "3.5", "[1, 2]", "yes"])
def test_an_answer_written_in_a_format_reads_back(answer_format, answer):
    assert extract_answer(format_answer(answer, answer_format), answer_format) == answer


def test_any_format_takes_the_one_that_starts_last():
    assert extract_any("<answer>1</answer>\n#### 2") == "2"
    assert extract_any("#### 2\n\\boxed{3}") == "3"
    assert extract_any("\\boxed{3} <answer>4</answer>") == "4"
    assert extract_any("no marker, 5") is None


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("5 - 3 = 2", "2"),
        ("It is -4.", "-4"),
        ("1,000 apples", "1000"),  # thousands commas dropped
        ("costs $3.50.", "3.50"),  # a sentence's full stop is not a decimal point
        ("<answer>7</answer> since 3 + 4", "4"),  # the LAST number, whatever the format says
        ("no digits", None),
    ],
)
def test_last_number(reply, expected):
    assert last_number(reply) == expected


def test_which_references_are_numeric():
    assert is_numeric("-3") and is_numeric("2.50") and is_numeric("1,000")
    assert not is_numeric("[1, 2]") and not is_numeric("yes") and not is_numeric("1e3")


# ---- checkers --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("She has 9 eggs.\n#### 9", Verdict(True, True, True, {"gsm8k_accuracy": True})),
        ("The answer is 9.", Verdict(True, False, True, {"gsm8k_accuracy": True})),  # right, not the #### line
        ("#### 9\nbecause 4 + 5", Verdict(False, True, True, {"gsm8k_accuracy": True})),  # last number 5
        ("I think 9", Verdict(True, False, False, {"gsm8k_accuracy": False})),  # no recognised format
        ("#### 8", Verdict(False, False, True, {"gsm8k_accuracy": False})),
        ("\\boxed{9.0}", Verdict(True, False, True, {"gsm8k_accuracy": True})),
        ("nothing", Verdict(False, False, False, {"gsm8k_accuracy": False})),
    ],
)
def test_gsm8k_checker(reply, verdict):
    got = GSM8KChecker().check(reply, "9")
    math_verify = got.extras.pop("accuracy_math_verify", None)
    assert got == verdict
    if math_verify is not None:  # the math-verify extra is installed: its verdict is the library's own
        from math_verify import parse, verify

        assert math_verify == bool(verify(parse("9"), parse(reply)))


def test_numeric_checker_reads_its_format():
    tag = NumericChecker(answer_format="tag")
    assert tag.check("<answer>1,200</answer>", "1200") == Verdict(True, True, True)
    assert tag.check("#### 1200", "1200") == Verdict(True, False, False)
    assert NumericChecker().check("#### 1200", "1200") == Verdict(True, True, True)


def exact(answer, entry):
    """A verifier with reasoning-gym's default rule: 1 for the oracle answer, len(oracle) / len(answer) when the
    answer contains it, else 0 (reasoning_gym.dataset.ProceduralDataset.score_answer)."""
    oracle = entry["answer"]
    if answer == oracle:
        return 1.0
    return len(oracle) / len(answer) if answer and oracle in answer else 0.0


def record(answer: str, answer_format: str = "tag") -> TaskRecord:
    return TaskRecord(entry={"question": "q", "answer": answer, "metadata": {}}, score_answer=exact,
                      answer_format=answer_format)  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "answer", "verdict"),
    [
        ("3 + 4 = 7\n<answer>7</answer>", "7", Verdict(True, True, True)),
        ("<answer>7</answer> from 3 and 4", "7", Verdict(False, True, True)),  # last number 4
        ("3 + 4 = 7", "7", Verdict(True, False, False)),  # right, not in the asked format
        ("<answer>17</answer>", "7", Verdict(False, False, True)),  # partial credit 0.5 is not correct
        ("#### 7", "7", Verdict(True, False, False)),
        ("I pick <answer>yes</answer>", "yes", Verdict(True, True, True)),  # not numeric: any format
        ("I pick\nyes", "yes", Verdict(True, False, False)),  # not numeric, no format: the last line
        ("", "7", Verdict(False, False, False)),
    ],
)
def test_reasoning_gym_checker(reply, answer, verdict):
    assert ReasoningGymChecker().check(reply, answer, record(answer)) == verdict


def test_format_free_answer_by_hand():
    assert format_free_answer("<answer>3</answer> so 3.", "3") == "3"
    assert format_free_answer("\\boxed{no}\nthat is all", "yes") == "no"
    assert format_free_answer("first\nsecond\n\n", "yes") == "second"
    assert format_free_answer("", "yes") is None


def test_the_checker_needs_a_record():
    with pytest.raises(ValueError, match="use data=reasoning_gym"):
        ReasoningGymChecker().check("7", "7", None)


def test_gsm8k_evaluation_reports_math_verify_beside_ours():
    """eval/accuracy_math_verify: math-verify's verdicts averaged over the replies (docs/answer_checking.md)."""
    pytest.importorskip("math_verify")
    from grpo_lightning.training.evaluation import verdict_metrics

    replies = ["#### 9", "The answer is 9.", "#### 8", "nothing"]  # math-verify: right, right, wrong, wrong
    metrics = verdict_metrics([GSM8KChecker().check(r, "9") for r in replies])
    assert metrics["eval/accuracy_math_verify"] == 0.5
    assert metrics["eval/gsm8k_accuracy"] == 0.5
