"""Rewards and evaluation for reasoning-gym's procedural tasks: each task's own verifier, `score_answer`.

reasoning-gym (Stojanovski et al. 2025, "Reasoning Gym: Reasoning Environments for Reinforcement Learning with
Verifiable Rewards", github.com/open-thought/reasoning-gym) generates problems with a verifier per task,
`dataset.score_answer(answer, entry) -> float in [0, 1]` (1 for a right answer; some tasks give partial
credit). The data source (grpo_lightning/data/reasoning_gym.py) attaches to each prompt a `TaskRecord`: the
entry, the verifier of the data set that generated it (some verifiers read that data set's config) and the
answer format the prompt asked for. Reward terms receive it as `info["record"]`.

* `ReasoningGymReward` (a reward term): the verifier's score of the answer written in the asked format; 0 when
  the reply has none. Strict on purpose: the reward teaches the format as well (rewards/answers.py).
* `AskedFormat` (a reward term): 1 when the reply holds an answer in the asked format, right or wrong.
* `ReasoningGymChecker` (evaluation): the verifier applied to a reading of the reply that does not depend on the
  format (the last number for a numeric answer), beside the strict reading (docs/data.md, "Evaluation").

This module never imports reasoning_gym: everything task-specific comes with the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from grpo_lightning.rewards.answers import extract_answer, extract_any, is_numeric, last_number
from grpo_lightning.rewards.base import AnswerChecker, RewardResult, RewardTerm, Verdict

READINGS = ("asked", "any")
"""How `ReasoningGymReward` reads a reply's answer: in the asked format only, or as evaluation reads it."""


@dataclass(frozen=True)
class TaskRecord:
    """What a reasoning-gym problem carries to the reward and the evaluation (`Prompt.record`)."""

    entry: dict
    """reasoning-gym's entry: `question`, `answer`, `metadata`."""
    score_answer: Callable[[str | None, dict], float]
    """The verifier of the data set that generated the entry."""
    answer_format: str
    """The format the prompt asked for (rewards/answers.py FORMATS)."""

    def score(self, answer: str | None) -> float:
        """The verifier's score of `answer` (None: no answer, 0), as a float in [0, 1]."""
        return 0.0 if answer is None else float(self.score_answer(answer, self.entry))


def task_record(record: Any, who: str) -> TaskRecord:
    """`record` when it is a `TaskRecord`, else a ValueError saying what `who` needs."""
    if not isinstance(record, TaskRecord):
        raise ValueError(
            f"{who} scores with the problem's reasoning-gym record, and this problem has none (got {record!r}); "
            "use data=reasoning_gym"
        )
    return record


@dataclass(frozen=True)
class ReasoningGymReward(RewardTerm):
    """The task's verifier on the answer in the asked format: its score in [0, 1]; 0 when there is none.

    `partial_credit: false` counts full marks only (1 or 0). Why offer it: several verifiers give a wrong answer
    that CONTAINS the right one partial credit (reasoning-gym's default and chain_sum's: "17" for 7 scores
    len("7") / len("17") = 0.5), which on arithmetic rewards a wrong number. Reports the answer (`extracted`: the
    asked format held one, `rollout/format_rate`) and `correct` (a score of 1).

    `reading: any` scores the answer read as evaluation's `eval/accuracy` reads it (`format_free_answer`: the
    last number of a numeric answer) instead of the one in the asked format. Why offer it: a small model that
    rarely writes the asked format gets almost no correctness signal from the strict reading at first (on
    chain_sum the embedded model writes a right answer in `\\boxed{}` in 0.5% of its samples but ends on the
    right number in 11%, docs/data.md), so the correctness reward reaches it from the first round; the format is
    then taught by a format term beside it (`experiment=learn_arith`). `extracted` still reports the asked
    format, so `rollout/format_rate` means the same under either reading.
    """

    reports_answer: ClassVar[bool] = True
    needs_record: ClassVar[bool] = True
    partial_credit: bool = True
    reading: str = "asked"

    def __post_init__(self) -> None:
        if not isinstance(self.partial_credit, bool):
            raise ValueError(f"partial_credit must be true or false (got {self.partial_credit!r})")
        if self.reading not in READINGS:
            raise ValueError(f"reading must be one of {', '.join(READINGS)} (got {self.reading!r})")

    def score(self, completion: str, reference: str, record: Any = None, **info: Any) -> RewardResult:
        task = task_record(record, type(self).__name__)
        extracted = extract_answer(completion, task.answer_format)
        answer = extracted if self.reading == "asked" else format_free_answer(completion, reference)
        value = task.score(answer)
        correct = answer is not None and value >= 1.0
        return RewardResult(reward=value if self.partial_credit else float(correct), extracted=extracted,
                            correct=correct)  # fmt: skip


class AskedFormat(RewardTerm):
    """1.0 when the reply holds an answer in the format its prompt asked for (right or wrong), else 0.0."""

    needs_record: ClassVar[bool] = True

    def score(self, completion: str, reference: str, record: Any = None, **info: Any) -> RewardResult:
        task = task_record(record, type(self).__name__)
        value = 0.0 if extract_answer(completion, task.answer_format) is None else 1.0
        return RewardResult(reward=value, extracted=None, correct=False)


def format_free_answer(completion: str, reference: str) -> str | None:
    """The reply's answer read without regard to the asked format: its last number when the reference is a
    number; otherwise the answer in any of the tag, hash and boxed formats (the last one), else the reply's
    last non-empty line."""
    if is_numeric(reference):
        return last_number(completion)
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return extract_any(completion) or (lines[-1] if lines else None)


class ReasoningGymChecker(AnswerChecker):
    """Evaluation of reasoning-gym problems: correct = the verifier scores the format-free answer 1; strict =
    it scores the answer in the asked format 1; formatted = the asked format holds an answer."""

    def check(self, completion: str, reference: str, record: Any = None) -> Verdict:
        task = task_record(record, type(self).__name__)
        asked = extract_answer(completion, task.answer_format)
        return Verdict(
            correct=task.score(format_free_answer(completion, reference)) >= 1.0,
            strict=task.score(asked) >= 1.0,
            formatted=asked is not None,
        )
