"""Answer checking by math-verify (HuggingFace's `math_verify` 0.9), the checker of TRL's `accuracy_reward` and
open-r1: a reward term (`reward=gsm8k_math_verify`) and a plain checker for evaluation (`math_verify_correct`).

math-verify parses the reference and the completion into SymPy objects and compares them symbolically, so it
accepts what `GSM8KReward` (rewards/gsm8k.py) does not: fractions (``37/2``, ``\\frac{37}{2}``), expressions
(``2 * 9``), space-grouped thousands, decimal commas, units and percent signs, and answers with no marker at all
(it falls back to the last number). It also prefers ``\\boxed{}`` over any later ``####`` line, and reads text
written after the answer. The classes where the two disagree, with an example each: docs/answer_checking.md.

Two extraction settings:

* ``default``: math-verify's own `parse` defaults, LaTeX and plain expressions (``#### 18`` and ``18 eggs`` parse);
  it accepts all 8,792 GSM8K reference answers' ``#### n`` lines, as `GSM8KReward` does, but misreads 26 whole
  reference solutions, whose steps use the word "answer" (its anchor) before the ``####`` line
  (benchmarks/answer_checkers.py).
* ``latex``: TRL's `accuracy_reward` exactly: LaTeX only, ``\\boxed{}`` first, nothing without a LaTeX anchor, so a
  plain ``#### 18`` is never found. Use it to reproduce a TRL or open-r1 run, not on GSM8K's own format.

math-verify is an optional dependency (the `math-verify` extra): imported on first use, and a term built without
it fails with one line naming its key. Its timeouts use ``signal.alarm``, which only works in the main thread; as
in TRL, a call from another thread runs without a timeout.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from grpo_lightning.rewards.base import RewardResult, RewardTerm

EXTRACTIONS = ("default", "latex")
INSTALL = "pip install 'grpo_lightning[math-verify]' (make install does)"
PARSE_TIMEOUT_S = 10  # TRL's accuracy_reward: 10 s to parse, 5 s to compare
VERIFY_TIMEOUT_S = 5


def _library():
    """The `math_verify` module, or a ValueError saying how to install it (the pipeline prefixes the term's key)."""
    try:
        import math_verify
    except ImportError:
        raise ValueError(f"math-verify is not installed: {INSTALL}") from None
    return math_verify


@functools.cache
def _extraction_config(extraction: str) -> list:
    mv = _library()
    if extraction == "default":
        return [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    from latex2sympy2_extended import NormalizationConfig

    latex = mv.LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    return [latex]


def _timeouts() -> tuple[int | None, int | None]:
    """(parse, verify) timeouts: none off the main thread, where math-verify's signal.alarm cannot run."""
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    for name in ("math_verify.parser", "math_verify.grader"):  # their "timeout is disabled" warning, once a call
        logging.getLogger(name).setLevel(logging.ERROR)
    return None, None


@functools.lru_cache(maxsize=65536)
def _parse_reference(reference: str, timeout: int | None) -> tuple:
    """The reference parsed with math-verify's defaults (as TRL parses its solution column); cached, since every
    completion of a group shares it."""
    return tuple(_library().parse(reference, parsing_timeout=timeout))


def math_verify_answer(completion: str, reference: str, extraction: str = "default") -> tuple[bool, str | None]:
    """(correct, the answer math-verify read as text, None when it found none) of one completion.

    ``reference`` is an extracted GSM8K answer such as ``"18"`` (any LaTeX or plain expression parses).
    """
    if extraction not in EXTRACTIONS:
        raise ValueError(f"extraction must be one of {', '.join(EXTRACTIONS)} (got {extraction!r})")
    mv = _library()
    parse_timeout, verify_timeout = _timeouts()
    gold = list(_parse_reference(reference, parse_timeout))
    if not gold:
        return False, None
    mode = "first_match" if extraction == "latex" else "any_match"  # TRL: first_match; math-verify: any_match
    answer = mv.parse(
        completion,
        extraction_config=_extraction_config(extraction),
        extraction_mode=mode,
        parsing_timeout=parse_timeout,
    )
    if not answer:
        return False, None
    text = next((a for a in answer if isinstance(a, str)), str(answer[0]))
    return bool(mv.verify(gold, answer, timeout_seconds=verify_timeout)), text


def math_verify_correct(completion: str, reference: str) -> bool:
    """Whether math-verify (its default extraction) finds the reference answer in ``completion``: the plain checker
    evaluation calls for `eval/accuracy_math_verify`."""
    return math_verify_answer(completion, reference)[0]


@dataclass(frozen=True)
class MathVerifyReward(RewardTerm):
    """1.0 when math-verify finds the reference answer in the completion, else 0.0 (TRL's `accuracy_reward`).

    Reports the answer it read, so `rollout/format_rate` counts completions where math-verify found any answer
    (with the default extraction that is nearly every completion holding a number).
    """

    reports_answer = True
    extraction: str = "default"

    def __post_init__(self) -> None:
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"extraction must be one of {', '.join(EXTRACTIONS)} (got {self.extraction!r})")
        _library()  # fail at construction, before any model loads

    def score_detailed(self, completion: str, reference: str) -> RewardResult:
        correct, extracted = math_verify_answer(completion, reference, self.extraction)
        return RewardResult(reward=1.0 if correct else 0.0, extracted=extracted, correct=correct)

    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        return self.score_detailed(completion, reference)
