"""Answer checkers for evaluation: numeric answers (`NumericChecker`) and GSM8K (`GSM8KChecker`).

Evaluation quotes `eval/accuracy` from a reading of the reply that does not depend on the answer format: the
last number of the reply, compared as a number with GSM8K's tolerance (rewards/answers.py says why). Beside it,
`eval/accuracy_strict` reads only the format the prompt asked for, and `eval/format_rate` says how often the
training reward found an answer. The reasoning-gym checker lives with its reward (rewards/reasoning_gym.py).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from grpo_lightning.rewards.answers import extract_answer, last_number
from grpo_lightning.rewards.base import AnswerChecker, Verdict
from grpo_lightning.rewards.gsm8k import _ABS_TOL, _ANSWER_PATTERNS, GSM8KReward, normalize_number
from grpo_lightning.rewards.math_verify import math_verify_correct


def same_number(predicted: str | None, reference: str) -> bool:
    """Both are plain numbers and equal within GSM8K's absolute tolerance (1e-6)."""
    a = normalize_number(predicted) if predicted is not None else None
    b = normalize_number(reference)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=0.0, abs_tol=_ABS_TOL)


@dataclass(frozen=True)
class NumericChecker(AnswerChecker):
    """A numeric reference answer: correct = the reply's last number equals it; strict = the answer in
    `answer_format` (rewards/answers.py) equals it; formatted = that format holds an answer."""

    answer_format: str = "hash"

    def check(self, completion: str, reference: str, record: Any = None) -> Verdict:
        asked = extract_answer(completion, self.answer_format)
        return Verdict(
            correct=same_number(last_number(completion), reference),
            strict=same_number(asked, reference),
            formatted=asked is not None,
        )


_HASH_LINE = _ANSWER_PATTERNS[0]
"""GSM8K's `#### <number>` pattern: the format its prompt asks for."""


@dataclass(frozen=True)
class GSM8KChecker(AnswerChecker):
    """GSM8K: correct = the last number; strict = the `#### <number>` answer (the format the prompt asks for);
    formatted = an answer the GSM8K reward recognises (`####`, `\\boxed{}`, "The answer is"), as
    `eval/format_rate` always counted; and `gsm8k_accuracy`, that reward's own correctness (what
    `eval/gsm8k_accuracy` has always been); where math-verify is installed, `accuracy_math_verify`, its verdict
    (docs/answer_checking.md), so that a number can be compared with tools that score with it (TRL, open-r1)."""

    reward: GSM8KReward = field(default_factory=lambda: GSM8KReward(format_bonus=0.0))

    def check(self, completion: str, reference: str, record: Any = None) -> Verdict:
        lenient = self.reward.score_detailed(completion, reference)
        hashes = [m.group("num") for m in _HASH_LINE.finditer(completion)]
        return Verdict(
            correct=same_number(last_number(completion), reference),
            strict=bool(hashes) and same_number(hashes[-1], reference),
            formatted=lenient.extracted is not None,
            extras={"gsm8k_accuracy": lenient.correct}
            | ({"accuracy_math_verify": math_verify_correct(completion, reference)} if math_verify_installed() else {}),
        )


@cache
def math_verify_installed() -> bool:
    """Whether the optional math-verify package can be imported (extra `math-verify`), asked without importing it."""
    return importlib.util.find_spec("math_verify") is not None
