"""reasoning-gym's procedural tasks as a data source: `data=reasoning_gym data.dataset.task=<name>` (docs/data.md).

reasoning-gym (PyPI `reasoning-gym`, the `reasoning-gym` extra; Stojanovski et al. 2025, "Reasoning Gym:
Reasoning Environments for Reinforcement Learning with Verifiable Rewards") generates problems of ~100 tasks,
each with a verifier. Why here: a 135M model answers almost no GSM8K problem, so GRPO has no reward spread to
learn from; a task of chosen difficulty (`chain_sum` of two one-digit terms) is right a quarter of the time.

Splits that share nothing. reasoning-gym draws item i of a data set from `Random(seed + i)`, so the training
problems are items 0..size-1 of seed `seed`, and the test split's come from `eval_seed` on, which must lie past
the training seeds (`eval_seed >= seed + size`, checked): no generator state of the test split is one of
training's. Small tasks still repeat questions across seeds (two one-digit terms have a few thousand), so the
test split also drops every question that is in the training set, and its own repeats, scanning at most
`CANDIDATES_PER_PROBLEM` items per test problem.

The task's keys are checked before anything loads, against the task's own config dataclass and its
`validate()`: a wrong name or a key the task does not take fails in one line naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from omegaconf import OmegaConf

from grpo_lightning.data.source import DataSource, Problem
from grpo_lightning.rewards.answers import FORMATS, format_answer
from grpo_lightning.rewards.reasoning_gym import ReasoningGymChecker, TaskRecord
from grpo_lightning.schema import check_settings, choice, integer, mapping_of, optional, setting, text

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[reasoning-gym]' (make install does)"
CANDIDATES_PER_PROBLEM = 20
"""The test split scans at most this many generator items per problem it needs before it settles for fewer."""
INSTRUCTIONS = {
    "tag": "Give the final answer as <answer>your answer</answer>.",
    "hash": "Give the final answer on its own line as '#### <answer>'.",
    "boxed": "Give the final answer as \\boxed{your answer}.",
    "plain": "Reply with the answer only.",
}
"""What the prompt's `{instruction}` says for each answer format (rewards/answers.py reads them)."""


def registry() -> dict | None:
    """reasoning-gym's tasks (name -> (data set class, config class)); None when it is not installed."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return None
    return DATASETS


def task_name(value) -> str | None:
    """A rule: the name of a reasoning-gym task (the closest names are suggested)."""
    tasks = registry()
    if tasks is None:
        return f"needs reasoning-gym: {INSTALL}"
    if isinstance(value, str) and value in tasks:
        return None
    close = difflib.get_close_matches(str(value), list(tasks), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "e.g. basic_arithmetic, chain_sum"
    return f"must be a reasoning-gym task ({len(tasks)} in reasoning_gym.factory.DATASETS; {hint})"


def template(value) -> str | None:
    """A rule: a prompt template with a `{question}` slot and, optionally, an `{instruction}` slot."""
    if not isinstance(value, str):
        return "must be a string"
    if "{question}" not in value:
        return "must contain '{question}'"
    try:
        value.format(question="", instruction="")
    except (KeyError, IndexError, ValueError):
        return "may have only the slots {question} and {instruction} (write a literal brace as {{ or }})"
    return None


def task_keys(task: str) -> list[str]:
    """The keys a task takes (its config dataclass's fields, less `seed` and `size`, which are ours)."""
    return [f.name for f in dataclasses.fields(registry()[task][1]) if f.name not in ("seed", "size")]


def plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@dataclass
class ReasoningGym(DataSource):
    """`data.dataset` for data=reasoning_gym: a task, its keys, the split seeds and the answer format."""

    gives_records: ClassVar[bool] = True
    """Each problem carries a `TaskRecord` (entry, verifier, answer format) for the reward and the evaluation."""
    has_solutions: ClassVar[bool] = True
    """Its problems have reference solutions (a dry run scores them against the reward)."""
    card_tags: ClassVar[tuple[str, ...]] = ("reasoning-gym",)

    task: str = setting("basic_arithmetic", task_name)
    task_config: dict = setting(
        rule=mapping_of("{min_terms: 2, max_digits: 1}"),
        factory=dict,
    )
    size: int = setting(1000, integer(1))
    seed: int = setting(0, integer(0))
    eval_seed: int = setting(1_000_000_000, integer(0))
    split: str = setting("train", choice("train", "test"))
    answer_format: str = setting("tag", choice(*FORMATS))
    system_prompt: str | None = setting(
        "You are a careful assistant. Think briefly, then give the final answer.",
        optional(text),
    )
    prompt_template: str = setting("{question}\n{instruction}", template)
    num_test: int = field(default=100, repr=False)
    """Problems of the test split (`test_split` sets eval.num_problems); not a config key."""

    def __post_init__(self) -> None:
        self.task_config = plain(self.task_config)
        check_settings(self, "data.dataset")

    @staticmethod
    def joint_problems(values: dict, prefix: str) -> list[str]:
        """The task's keys against the task, and the test split's seeds past the training ones."""
        if "task" not in values:
            return []
        task, config = values["task"], dict(values.get("task_config") or {})
        accepted = task_keys(task)
        for key in config:
            if key not in accepted:
                extra = "; set data.dataset.seed / size instead" if key in ("seed", "size") else ""
                return [
                    f"{prefix}.task_config.{key}: not a key of reasoning-gym task {task!r} "
                    f"(its keys: {', '.join(accepted)}){extra}"
                ]
        try:
            registry()[task][1](**config).validate()
        except Exception as err:  # noqa: BLE001 - reasoning-gym validates with assert; a bad type may raise others
            return [f"{prefix}.task_config: reasoning-gym task {task!r} rejects {config} ({err or type(err).__name__})"]
        seed, size, eval_seed = (values.get(k) for k in ("seed", "size", "eval_seed"))
        if None not in (seed, size, eval_seed) and eval_seed < seed + size:
            return [
                f"{prefix}.eval_seed ({eval_seed}) must be >= {prefix}.seed + {prefix}.size ({seed + size}): "
                "reasoning-gym draws item i from Random(seed + i), and the test split must share no generator "
                "seed with the training problems"
            ]
        return []

    def describe(self) -> str:
        if self.split == "train":
            return f"reasoning-gym {self.task} (train: {self.size} problems of seed {self.seed})"
        return f"reasoning-gym {self.task} (test: {self.num_test} held-out problems from seed {self.eval_seed})"

    def card_description(self) -> str:
        """The model card's words: the task, its keys and the training problems."""
        return f"reasoning-gym task `{self.task}` {dict(self.task_config)}, {self.size} problems"

    def test_split(self, path: str | None = None, num_problems: int | None = None) -> ReasoningGym:
        """`eval.dataset`: the same task and prompt, `num_problems` held-out problems (`path` is for files)."""
        return replace(self, split="test", num_test=num_problems or self.num_test)

    def checker(self, reward: Any = None) -> ReasoningGymChecker:
        """Evaluation's judge (`eval.checker: null`); `eval.reward` is GSM8K's and is not used here."""
        return ReasoningGymChecker()

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one problem: the template with the answer format's instruction."""
        user = self.prompt_template.format(question=question, instruction=INSTRUCTIONS[self.answer_format])
        if self.system_prompt:
            return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        return [{"role": "user", "content": user}]

    # ---- problems --------------------------------------------------------------------------------------------
    def generator(self, seed: int, size: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(self.task, seed=seed, size=size, **self.task_config)

    def problem(self, dataset, entry: dict) -> Problem:
        answer = str(entry["answer"])
        record = TaskRecord(entry=entry, score_answer=dataset.score_answer, answer_format=self.answer_format)
        return Problem(str(entry["question"]), format_answer(answer, self.answer_format), answer, record)

    def load(self) -> list[Problem]:
        train = self.generator(self.seed, self.size)
        train_problems = [self.problem(train, train[i]) for i in range(self.size)]
        return train_problems if self.split == "train" else self.held_out({p.question for p in train_problems})

    def held_out(self, seen: set[str]) -> list[Problem]:
        """`num_test` problems from `eval_seed` on whose questions are neither in `seen` nor repeated."""
        scan = self.num_test * CANDIDATES_PER_PROBLEM
        test, problems = self.generator(self.eval_seed, scan), []
        for i in range(scan):
            entry = test[i]
            if entry["question"] in seen:
                continue
            seen.add(entry["question"])
            problems.append(self.problem(test, entry))
            if len(problems) == self.num_test:
                return problems
        if not problems:
            raise ValueError(
                f"data.dataset: every one of {scan} test candidates of task {self.task!r} is a training question; "
                "lower data.dataset.size or widen data.dataset.task_config"
            )
        log.warning(
            "reasoning-gym %s: only %d held-out questions in %d candidates (eval.num_problems=%d): the %d training "
            "problems cover most of the task's questions; lower data.dataset.size or widen data.dataset.task_config",
            self.task, len(problems), scan, self.num_test, self.size,
        )  # fmt: skip
        return problems
