"""What the reward pipeline (`grpo_lightning.rewards.pipeline`) asks of its stages, `RewardTerm` and `Transform`,
and what evaluation asks of an answer checker, `AnswerChecker`.

The pipeline calls every stage the same way, whatever it is: a term's `score`, a transform's call, and for both
`bind`, `state_dict`, `load_state_dict` and `describe_settings`, whose defaults here are those of a stateless
stage that needs no context. The built-in terms and transforms derive from these classes. A plain function (or
an object of a class that derives from neither) is wrapped by the pipeline builder into a stage with these
defaults, called with the `info` keys its signature names (docs/rewards.md).

Like gsm8k.py, this module imports only the standard library.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one completion.

    ``extracted`` is the predicted answer string (None when no answer format matched), so callers can
    compute a format rate as the fraction of results whose ``extracted`` is not None.
    """

    reward: float
    extracted: str | None
    correct: bool
    terms: dict[str, float] | None = field(default=None, compare=False)
    """Unweighted value of each reward term (set by the reward pipeline, `grpo_lightning.rewards.pipeline`)."""


class Stage:
    """What the pipeline asks of every term and transform besides scoring: the run's context and its state.

    The defaults describe a stage that needs no context and keeps no state, which is every built-in but
    `GroupNormalize` (told the loss) and `EMABaseline` (a baseline across rounds).
    """

    needs_record: ClassVar[bool] = False
    """Whether the stage reads `info["record"]`, the per-problem record a data source attaches (data=reasoning_gym
    gives one); the config check refuses such a stage with a data source that gives none."""
    record_source: ClassVar[str] = "data=reasoning_gym"
    """The choice that gives the records such a stage reads: the config check's advice when they are missing."""

    def bind(self, loss_type: str | None = None, max_new_tokens: int | None = None) -> None:
        """Take the run's loss type and completion budget (the pipeline builder calls this once). No-op."""

    def state_dict(self) -> dict:
        """The state a resumed run needs, saved in every checkpoint; empty means stateless (not saved)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned. No-op: a stateless stage is never given a state."""

    def describe_settings(self) -> str:
        """Settings the run plan names beside the stage's name (`normalize(scale=group)`); none by default."""
        return ""


class RewardTerm(Stage, ABC):
    """A reward term: one number for a completion against the reference answer (`reward.terms.<name>`).

    `score` takes every `info` key as a keyword (`truncated`, `num_tokens`, `max_new_tokens`, `branch_point`,
    `record`, and from variants that know steps `branch_step`), so a term reads the ones it needs and ignores the
    rest.
    """

    reports_answer: ClassVar[bool] = False
    """Whether `score` says if an answer was found (`extracted`) and right (`correct`). The pipeline takes both
    from the first term that does (`rollout/format_rate`); without one, nothing counts as extracted and
    `correct` is `reward >= 1`. A term that does not report leaves `extracted` None and `correct` False."""

    @abstractmethod
    def score(self, completion: str, reference: str, **info: Any) -> RewardResult:
        """The term's unweighted value (`reward`) and, when it `reports_answer`, the answer it found."""

    def __call__(self, completion: str, reference: str, **info: Any) -> float:
        return self.score(completion, reference, **info).reward


class Transform(Stage, ABC):
    """A reward transform. Its call depends on where the config puts it (docs/rewards.md):

    - `reward.transforms`: `(reward, **info) -> float`, on the weighted sum of the terms;
    - `reward.step_transforms`: `(reward, steps, **info) -> float`, `steps` the completion's reasoning steps;
    - `reward.group_transforms`: `(rewards [N], group_ids [N]) -> [N]` torch tensors, over a round's rewards;
      the last one's output is the advantage.

    Per-completion and per-step transforms are given every `info` key, as terms are.
    """

    baseline: ClassVar[str] = "none"
    """What a group transform subtracts: `group` (each group's own mean), `own` (a baseline from outside the group:
    a running mean, the round's mean) or `none` (it does not centre). STORPO's tree credit values a forest's root by
    it (algorithm/tree_advantages.py)."""

    @abstractmethod
    def __call__(self, *args: Any, **info: Any) -> Any:
        """The transform, with the arguments of its place (above)."""


@dataclass(frozen=True)
class Verdict:
    """How evaluation judges one reply (training/evaluation.py; docs/data.md, "Evaluation").

    `correct` and `strict` differ in where the answer is read: `correct` from a reading that does not depend on
    the answer format (the last number of the reply for a numeric answer), `strict` only from the format the
    prompt asked for. A reply can be strict and not correct ("<answer>3</answer>, since 1 + 2 = 3" ends in 3;
    "<answer>3</answer> from 1 and 2" ends in 2).
    """

    correct: bool
    """The format-independent reading of the reply is right (`eval/accuracy`, pass@k)."""
    strict: bool
    """The answer in the asked format is right (`eval/accuracy_strict`)."""
    formatted: bool
    """An answer was found in the format the training reward reads (`eval/format_rate`)."""
    extras: dict[str, bool] = field(default_factory=dict)
    """Further per-reply accuracies a data set keeps (GSM8K: `gsm8k_accuracy`), each logged as `eval/<name>`
    with its 95% interval."""


class AnswerChecker(ABC):
    """Judges a reply against its problem for evaluation (`eval.checker`; null: the data set's own).

    Given the problem's reference answer and its `record` (the opaque per-problem object a data source attaches
    to its prompts, e.g. a reasoning-gym entry with its verifier; None for GSM8K).
    """

    @abstractmethod
    def check(self, completion: str, reference: str, record: Any = None) -> Verdict:
        """The verdict on one reply."""
