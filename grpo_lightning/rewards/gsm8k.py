"""GSM8K reward: a pure, tensor-free function of (completion, reference answer).

GSM8K reference solutions end with a line ``#### <answer>`` (Cobbe et al., 2021, "Training Verifiers to
Solve Math Word Problems"), so the reference answer is the text after the *last* ``####``, with thousands
commas removed (the test split writes e.g. ``#### 1,450,000``).

The reward follows the rule-based outcome reward used by DeepSeekMath's GRPO (Shao et al., 2024):
1.0 for a correct final answer, a small ``format_bonus`` for a completion that states a
final answer in a recognised format but gets it wrong, and 0.0 when no answer can be extracted.

Design choices:

* A prediction is recognised in three formats: ``#### <num>`` (the GSM8K format), ``\\boxed{<num>}`` (the
  MATH/DeepSeekMath convention) and ``The answer is <num>`` (case-insensitive; the chain-of-thought
  few-shot convention). An optional ``$`` and markdown emphasis (``**``, ``_``) may precede the number.
* Among all matches of all formats, the one that *starts last* in the text wins ("first match, searched
  from the end"): models often restate or revise intermediate numbers, and the final statement is the
  answer they commit to.
* Answers are compared as numbers, not strings, so ``18``, ``18.0``, ``18.00``, ``$18`` and ``18.`` are all
  equal, with an absolute tolerance of 1e-6 to absorb float rounding of decimal answers.

Beside the reward, plain checkers `(completion, reference) -> bool` for evaluation: `gsm8k_correct` (this module's
extraction) and `strict_correct` (the `#### <number>` line only, as verl's GSM8K scorer); math-verify's is in
`grpo_lightning.rewards.math_verify`. Where they disagree and why: docs/answer_checking.md.

This module deliberately imports neither Lightning nor Hydra, only the standard library (and the stdlib-only
interfaces in `grpo_lightning.rewards.base`, which also define `RewardResult`).
"""

import logging
import math
import re
from dataclasses import dataclass

from grpo_lightning.rewards.base import RewardResult, RewardTerm

logger = logging.getLogger(__name__)

# Optional leading minus; digits with well-formed thousands commas or plain digits; optional decimal part.
# A trailing "." (sentence end) is never part of the number because a decimal point needs a digit after it.
_NUMBER = r"-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
# Between a marker and the number: whitespace, colons, markdown emphasis, and an optional dollar sign.
_LEAD = r"[\s:*_]*(?:\\?\$)?[\s*_]*"

_ANSWER_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"####" + _LEAD + r"(?P<num>" + _NUMBER + r")"),
    re.compile(r"\\boxed\{\s*(?:\\?\$)?\s*(?P<num>" + _NUMBER + r")\.?\s*\}"),
    re.compile(r"\bthe answer is" + _LEAD + r"(?P<num>" + _NUMBER + r")", re.IGNORECASE),
)

# What normalize_number accepts once "$", ",", surrounding whitespace and a trailing "." are removed.
# Stricter than float(): rejects "nan", "inf", "1e3", "1_000".
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")

_ABS_TOL = 1e-6

# verl's strict GSM8K extraction (verl/utils/reward_score/gsm8k.py, method="strict"): "#### " and one space, then
# digits, dots and commas with an optional minus; the last such line counts.
_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def extract_reference_answer(solution: str) -> str | None:
    """Return the GSM8K reference answer: text after the last ``####``, stripped, commas removed.

    Returns None when the solution contains no ``####``.
    """
    if "####" not in solution:
        return None
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def find_predicted_answer(completion: str) -> re.Match[str] | None:
    """The answer match that starts last in ``completion`` (its number is the group ``num``), or None.

    Recognised formats: ``#### <num>``, ``\\boxed{<num>}`` and ``The answer is <num>`` (case-insensitive).
    """
    best: re.Match[str] | None = None
    for pattern in _ANSWER_PATTERNS:
        for match in pattern.finditer(completion):
            if best is None or match.start() > best.start():
                best = match
    return best


def extract_predicted_answer(completion: str) -> str | None:
    """Return the number string of the answer match that starts last in ``completion``, or None.

    The returned string is the raw number as written (it may contain thousands commas).
    """
    match = find_predicted_answer(completion)
    return None if match is None else match.group("num")


def normalize_number(text: str) -> float | None:
    """Parse a written number, ignoring ``$``, ``,``, surrounding whitespace and one trailing ``.``.

    Returns None when the text is not a plain finite decimal number.
    """
    cleaned = text.replace("$", "").replace(",", "").strip().removesuffix(".").strip()
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    return float(cleaned)


def extract_strict_answer(completion: str) -> str | None:
    """The number of the last ``#### <number>`` in ``completion``, commas removed, or None: verl's strict GSM8K
    extraction, which also tests the format (exactly one space after ``####``, no ``$``, no words)."""
    matches = _STRICT_ANSWER.findall(completion)
    return matches[-1].replace(",", "") if matches else None


def strict_correct(completion: str, reference: str) -> bool:
    """Whether the last ``#### <number>`` is the reference answer as written (verl compares the strings, so
    ``18.0`` and ``18.`` are wrong against ``18``). ``reference`` is an extracted answer such as ``"18"``."""
    answer = extract_strict_answer(completion)
    return answer is not None and answer == reference.replace(",", "").strip()


def gsm8k_correct(completion: str, reference: str) -> bool:
    """Whether `GSM8KReward` finds the reference answer (``####``, ``\\boxed{}`` or "the answer is", compared as
    numbers). ``reference`` is an extracted answer such as ``"18"``."""
    return _CHECKER.score_detailed(completion, reference).correct


@dataclass(frozen=True)
class GSM8KReward(RewardTerm):
    """Reward 1.0 for a numerically correct answer, ``format_bonus`` for a wrong one, 0.0 for none."""

    reports_answer = True
    format_bonus: float = 0.1

    def __post_init__(self) -> None:
        bonus = self.format_bonus
        valid_type = isinstance(bonus, (int, float)) and not isinstance(bonus, bool)
        if not (valid_type and math.isfinite(bonus) and 0.0 <= bonus < 1.0):
            raise ValueError(f"format_bonus must be in [0, 1) (got {bonus!r})")

    def score_detailed(self, completion: str, reference: str) -> RewardResult:
        """Score ``completion`` against an already-extracted reference answer such as ``"18"``."""
        extracted = extract_predicted_answer(completion)
        if extracted is None:
            return RewardResult(reward=0.0, extracted=None, correct=False)
        expected = normalize_number(reference)
        if expected is None:
            logger.warning("GSM8K reference answer %r is not a number; scoring as incorrect", reference)
        predicted = normalize_number(extracted)
        correct = (
            expected is not None
            and predicted is not None
            and math.isclose(predicted, expected, rel_tol=0.0, abs_tol=_ABS_TOL)
        )
        reward = 1.0 if correct else float(self.format_bonus)
        return RewardResult(reward=reward, extracted=extracted, correct=correct)

    def score(self, completion: str, reference: str, **info) -> RewardResult:
        """The reward term: `score_detailed` (the rollout's `info` does not matter to correctness)."""
        return self.score_detailed(completion, reference)


_CHECKER = GSM8KReward(format_bonus=0.0)


@dataclass(frozen=True)
class AnswerFormat(RewardTerm):
    """1.0 when the completion states a final answer in a recognised format (correct or not), else 0.0.

    A reward term (`reward=gsm8k_shaped`): with weight 0.1 beside a correctness term of format_bonus 0, a wrong
    answer in a recognised format scores what today's format bonus gives it, and a correct one 1.1.
    """

    def score(self, completion: str, reference: str, **info) -> RewardResult:
        value = 0.0 if extract_predicted_answer(completion) is None else 1.0
        return RewardResult(reward=value, extracted=None, correct=False)


@dataclass(frozen=True)
class OverlongPenalty(RewardTerm):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), a reward term in [-1, 0].

    With L_max = `max_new_tokens` and a buffer of L_cache = `buffer_fraction` x L_max tokens: 0 up to
    L_max - L_cache tokens, then falling linearly to -1 at L_max. A truncated completion (cut at L_max without
    an end of sequence, DAPO's |y| > L_max) scores `truncated_penalty`. Needs the rollout's `num_tokens`,
    `max_new_tokens` and `truncated` (the pipeline passes them); without a token count it scores 0.
    """

    buffer_fraction: float = 0.2
    truncated_penalty: float = -1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.buffer_fraction <= 1.0:
            raise ValueError(f"buffer_fraction must be in (0, 1] (got {self.buffer_fraction!r})")
        if not (math.isfinite(self.truncated_penalty) and self.truncated_penalty <= 0.0):
            raise ValueError(f"truncated_penalty must be a finite number <= 0 (got {self.truncated_penalty!r})")

    def score(
        self,
        completion: str,
        reference: str,
        truncated: bool = False,
        num_tokens: int | None = None,
        max_new_tokens: int | None = None,
        **info,
    ) -> RewardResult:
        if truncated:
            value = float(self.truncated_penalty)
        elif num_tokens is None or not max_new_tokens:
            value = 0.0
        else:
            cache = max(self.buffer_fraction * max_new_tokens, 1.0)
            expected = max_new_tokens - cache
            value = 0.0 if num_tokens <= expected else max((expected - num_tokens) / cache, -1.0)
        return RewardResult(reward=value, extracted=None, correct=False)
