"""The GSM8K answer checkers on hand-written replies, one or more per class of disagreement in
docs/answer_checking.md: what verl's strict `#### n`, ours (GSM8KReward), math-verify with its defaults and
math-verify as TRL's accuracy_reward (LaTeX only) each return, written by hand from reading the three
implementations, and the class benchmarks/answer_checkers.py puts the reply in. Also the math-verify reward term:
its presets, its one-line error without the package, and calls off the main thread."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest
from hydra.utils import instantiate

pytest.importorskip("math_verify", reason="the math-verify extra (make install installs it)")

from benchmarks.answer_checkers import classify, judge, readings_differ  # noqa: E402
from grpo_lightning.rewards import math_verify as mv_module  # noqa: E402
from grpo_lightning.rewards.gsm8k import extract_strict_answer, gsm8k_correct, strict_correct  # noqa: E402
from grpo_lightning.rewards.math_verify import MathVerifyReward, math_verify_correct  # noqa: E402
from grpo_lightning.rewards.pipeline import build_reward  # noqa: E402
from tests.conftest import make_cfg  # noqa: E402

# (reply, reference, (strict, ours, math-verify, math-verify latex-only), class of the ours/math-verify split)
CASES = [
    # no ####, \boxed or "the answer is": ours reads nothing; math-verify takes "Answer:", "final answer is" or the
    # last number
    pytest.param("She has 16 - 3 - 4 = 9 eggs left and earns 9 * 2 = 18 dollars.", "18", (0, 0, 1, 0), "no_marker",
                 id="last-number-no-marker"),
    pytest.param("Answer: 18", "18", (0, 0, 1, 0), "no_marker", id="answer-colon"),
    pytest.param("The final answer is $18$. I hope it is correct.", "18", (0, 0, 1, 1), "no_marker",
                 id="final-answer-latex"),
    # text after the marked answer: math-verify reads its last number
    pytest.param("#### 18\nThat is 2 more than 16.", "18", (1, 1, 0, 0), "after_answer", id="text-after-answer"),
    # a word "answer" earlier: math-verify's anchor `answer.{0,50}?<number>` outranks the plain last number
    pytest.param("She takes 2 minutes to answer each question, so 30 questions take 60 minutes.\n#### 60", "60",
                 (1, 1, 0, 0), "answer_word", id="answer-word-earlier"),
    # \boxed then a later ####: ours takes the statement that starts last, math-verify prefers the box
    pytest.param("So she makes \\boxed{18} dollars.\n#### 20", "18", (0, 0, 1, 1), "boxed", id="boxed-right"),
    pytest.param("So she makes \\boxed{18} dollars.\n#### 20", "20", (1, 1, 0, 0), "boxed", id="later-hashes-right"),
    # the number glued to ####: math-verify's numbers need a space, `=` or line start before them
    pytest.param("####18", "18", (0, 1, 0, 0), "glued", id="no-space"),
    pytest.param("#### \\$18", "18", (0, 1, 0, 0), "glued", id="escaped-dollar"),
    # fractions: math-verify evaluates them, ours reads the numerator (or nothing inside \boxed)
    pytest.param("#### 37/2", "18.5", (0, 0, 1, 0), "fractions", id="slash-fraction"),
    pytest.param("\\boxed{\\frac{37}{2}}", "18.5", (0, 0, 1, 1), "fractions", id="latex-fraction"),
    # expressions: math-verify evaluates them, ours reads the first number
    pytest.param("#### 2 * 9", "18", (0, 0, 1, 0), "expressions", id="product"),
    # digit grouping: spaces, a decimal comma, LaTeX's {,}
    pytest.param("#### 1 450 000", "1450000", (0, 0, 1, 0), "commas", id="space-thousands"),
    pytest.param("#### 3,5", "3.5", (0, 0, 1, 0), "commas", id="decimal-comma"),
    pytest.param("\\boxed{1{,}000}", "1000", (0, 0, 1, 1), "commas", id="latex-comma"),
    # units and percent: math-verify strips units and reads 25% as 25 or as 0.25
    pytest.param("\\boxed{18 \\text{ dollars}}", "18", (0, 0, 1, 1), "units_percent", id="boxed-unit"),
    pytest.param("#### USD 18", "18", (0, 0, 1, 0), "units_percent", id="unit-before-number"),
    pytest.param("#### 25%", "0.25", (0, 0, 1, 0), "units_percent", id="percent-as-fraction"),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "reference", "expected", "kind"), CASES)
def test_each_checker_on_each_disagreement_class(reply, reference, expected, kind):
    verdicts = judge(reply, reference)
    got = (verdicts.strict, verdicts.ours, verdicts.math_verify, verdicts.math_verify_latex)
    assert got == tuple(bool(x) for x in expected)
    assert (strict_correct(reply, reference), gsm8k_correct(reply, reference)) == got[:2]  # the plain checkers
    assert math_verify_correct(reply, reference) is got[2]
    assert classify(reply, verdicts.math_verify_answer) == kind


@pytest.mark.parametrize(
    ("reply", "differ"),
    [
        ("#### 18", False),  # both read 18
        ("The answer is 18.", False),
        ("#### 1,450,000", False),  # the same number, grouped
        ("#### 18\nThat is 2 more than 16.", True),  # ours 18, math-verify 16
        ("So she makes \\boxed{18} dollars.\n#### 20", True),  # ours 20, math-verify 18
        ("####18", True),  # ours 18, math-verify nothing
        ("She has 9 eggs left.", True),  # ours nothing, math-verify 9
        ("She has no eggs left.", False),  # neither reads a number
        ("#### 37/2", True),  # ours 37, math-verify 18.5
    ],
)
def test_readings_differ_whatever_the_reference(reply, differ):
    """benchmarks/answer_checkers.py's reading report: what ours and math-verify read, right or wrong, against the
    readings written by hand beside each reply."""
    assert readings_differ(reply, judge(reply, "0").ours_answer) is differ


@pytest.mark.parametrize(
    ("reply", "reference", "expected"),
    [
        ("#### 18", "18", (1, 1, 1)),  # GSM8K's own format: every checker accepts it
        ("#### 1,450,000", "1450000", (1, 1, 1)),
        ("#### -3", "-3", (1, 1, 1)),
        ("#### 25%", "25", (1, 1, 1)),  # math-verify accepts 25% for 25 as well as for 0.25
        ("#### 18.0", "18", (0, 1, 1)),  # strict compares strings, as verl does
        ("#### 18.", "18", (0, 1, 1)),  # a sentence's full stop is part of the strict number
        ("#### 1,45,000", "145000", (1, 0, 0)),  # strict drops every comma; the others read 1 and 1.45
        ("The answer is 18.", "18", (0, 1, 1)),  # strict needs the #### line
        ("#### 12\n#### 18", "18", (1, 1, 1)),  # the last #### counts
    ],
)
def test_where_strict_differs_from_the_others(reply, reference, expected):
    assert (strict_correct(reply, reference), gsm8k_correct(reply, reference)) == tuple(map(bool, expected[:2]))
    assert math_verify_correct(reply, reference) is bool(expected[2])


def test_strict_extraction_is_verls():
    # verl/utils/reward_score/gsm8k.py, method="strict": re.findall("#### (\\-?[0-9\\.\\,]+)"), last, commas removed
    assert extract_strict_answer("#### 1,000\n#### -2.5") == "-2.5"
    assert extract_strict_answer("####  7") is None and extract_strict_answer("#### $7") is None
    assert extract_strict_answer("#### 7 dollars") == "7"


def test_math_verify_term_and_preset():
    term = MathVerifyReward()
    result = term.score("#### 37/2", "18.5")
    assert (result.reward, result.correct, result.extracted) == (1.0, True, "37/2")
    assert term.score("no number here", "18").extracted is None
    assert MathVerifyReward(extraction="latex").score("#### 18", "18").reward == 0.0  # TRL's: LaTeX only
    with pytest.raises(ValueError, match="extraction must be one of default, latex"):
        MathVerifyReward(extraction="plain")


def test_reward_presets_and_an_added_term(tmp_path):
    preset = make_cfg(tmp_path, ["reward=gsm8k_math_verify"])
    pipeline = build_reward(preset.reward)
    assert pipeline.describe() == "1 x math_verify -> normalize(scale=group)"
    assert pipeline("#### 2 * 9", "18") == 1.0 and pipeline("#### 2 * 9", "17") == 0.0
    target = "+reward.terms.math_verify._target_=grpo_lightning.rewards.math_verify.MathVerifyReward"
    added = build_reward(make_cfg(tmp_path, [target, "+reward.terms.math_verify.weight=0"]).reward)
    result = added.score_completion("#### 2 * 9", "18")  # logged beside ours, not trained on
    assert result.terms == {"gsm8k": 0.1, "math_verify": 1.0} and result.reward == pytest.approx(0.1)


def test_without_math_verify_the_term_fails_in_one_line_naming_its_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises ImportError
    cfg = make_cfg(tmp_path, ["reward=gsm8k_math_verify"])
    with pytest.raises(ValueError) as err:
        build_reward(cfg.reward)
    message = str(err.value)
    assert message.startswith("reward.terms.math_verify: math-verify is not installed: pip install")
    assert "\n" not in message


def test_off_the_main_thread_math_verify_runs_without_its_signal_timeout():
    out = {}

    def check():
        try:
            out["value"] = (math_verify_correct("#### 2 * 9", "18"), math_verify_correct("#### 19", "18"))
        except Exception as err:  # noqa: BLE001 - reported below
            out["value"] = err

    thread = threading.Thread(target=check)
    thread.start()
    thread.join()
    assert out["value"] == (True, False)
    assert mv_module._timeouts() == (mv_module.PARSE_TIMEOUT_S, mv_module.VERIFY_TIMEOUT_S)  # main thread


DOC = Path(__file__).resolve().parents[2] / "docs" / "answer_checking.md"


def test_the_docs_table_of_classes_is_what_the_checkers_return():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and line.count("|") == 8]
    examples = [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows[1:]]  # past the header
    assert len(examples) == 15
    for kind, reply, reference, *expected in examples:
        reply = reply.strip("`").replace("\\n", "\n")
        verdicts = judge(reply, reference)
        got = (verdicts.strict, verdicts.ours, verdicts.math_verify, verdicts.math_verify_latex)
        assert got == tuple(x == "1" for x in expected), (kind, reply)
    documented = {reply.strip("`") for _, reply, *_ in examples}
    tested = {case.values[0].replace("\n", "\\n") for case in CASES}
    assert documented <= tested  # every documented row is one of the parametrised cases above


def test_the_docs_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(DOC), "exec"), {})


def test_math_verify_can_score_the_evaluation(tmp_path):
    overrides = [
        "eval.reward._target_=grpo_lightning.rewards.math_verify.MathVerifyReward",
        "~eval.reward.format_bonus",
    ]
    reward = instantiate(make_cfg(tmp_path, overrides).eval.reward)
    result = reward.score_detailed("#### 2 * 9", "18")  # what the evaluator calls
    assert result.correct and result.extracted == "2 * 9"
