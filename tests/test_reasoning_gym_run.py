"""data=reasoning_gym end to end on the tiny model: source, reward and evaluation in a real run, the CLI's one-line
refusal, and learning against an lr=0 control through a reasoning-gym task's own verifier."""

from __future__ import annotations

import os
from dataclasses import dataclass
from random import Random

import pytest
import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS, register_dataset

from grpo_lightning.app.train import build_run
from grpo_lightning.rewards.answers import last_number
from grpo_lightning.training.evaluation import wilson_interval
from grpo_lightning.training.rollout_loop import RolloutLoop
from tests.conftest import ROOT, make_cfg
from tests.forked_cli import cli_run

pytestmark = pytest.mark.slow

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
RUN = [
    "model=tiny",
    "data=reasoning_gym",
    "reward=reasoning_gym_shaped",  # the overlong term gives the random model's groups a reward spread
    *(f"++data.dataset.task_config.{k}={v}" for k, v in SMALL.items()),
    "data.dataset.size=200",
    "data.dataset.eval_seed=200",
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "generator.max_new_tokens=8",
    "eval.num_problems=16",
    "optim.optimizer.lr=1e-3",
]


def test_a_run_evaluates_held_out_problems_and_its_metrics_rescore(tmp_path):
    """The logged evaluation against a re-scoring of the evaluator's replies with reasoning-gym itself: the held-out
    entries regenerated from the test seed, the task's own verifier on each reply's last number, the mean and its
    Wilson interval by hand; and no evaluated question among the training problems."""
    run = build_run(make_cfg(tmp_path / "run", RUN))
    metrics = run.fit()
    replies = run.evaluator.last_replies
    assert len(replies) == 16 and len(run.evaluator.history) == 2  # at the start and after the last round

    train = {e["question"] for e in reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=200, **SMALL)}
    verifier = reasoning_gym.create_dataset("basic_arithmetic", seed=200, size=16 * 20, **SMALL)
    held_out: dict[str, dict] = {}
    for entry in verifier:
        held_out.setdefault(entry["question"], entry)
    right = strict = formatted = 0
    for r in replies:
        assert r["question"] not in train
        entry = held_out[r["question"]]
        assert entry["answer"] == r["answer"]
        number = last_number(r["completion"])
        right += number is not None and verifier.score_answer(number, entry) == 1.0
        tagged = r["completion"].split("<answer>")[-1].split("</answer>")[0].strip()
        has_tag = "<answer>" in r["completion"] and "</answer>" in r["completion"].split("<answer>")[-1] and tagged
        formatted += bool(has_tag)
        strict += bool(has_tag) and verifier.score_answer(tagged, entry) == 1.0
    assert metrics["eval/accuracy"] == right / 16
    assert (metrics["eval/accuracy_ci95_low"], metrics["eval/accuracy_ci95_high"]) == wilson_interval(right, 16)
    assert metrics["eval/accuracy_strict"] == strict / 16 and metrics["eval/format_rate"] == formatted / 16
    assert "eval/gsm8k_accuracy" not in metrics
    for key in ("summary/eval_accuracy_start", "summary/eval_accuracy_end", "summary/eval_accuracy_end_ci95_low",
                "summary/eval_accuracy_strict_end"):  # fmt: skip
        assert key in metrics, key
    assert metrics["summary/eval_accuracy_end"] == metrics["eval/accuracy"]
    assert {"reward/verifier_mean", "reward/format_mean", "reward/overlong_mean"} <= set(metrics)


def test_the_cli_refuses_a_wrong_task_key_in_one_line_and_takes_a_plain_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}

    def cli(*args):
        return cli_run("data=reasoning_gym", "reward=reasoning_gym", "dry_run=true", *args, cwd=tmp_path, env=env)

    bad = cli("data.dataset.task_config.min_termz=2")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == [
        "error: data.dataset.task_config.min_termz: not a key of reasoning-gym task 'basic_arithmetic' (its keys: "
        "min_terms, max_terms, min_digits, max_digits, operators, allow_parentheses, allow_negation, format_style, "
        "whitespace)"
    ]
    good = cli("data.dataset.task=chain_sum", "data.dataset.task_config.max_digits=1")
    assert good.returncode == 0, good.stderr
    assert "reasoning-gym chain_sum" in good.stdout and "reference solutions score 1.0000" in good.stdout


# ---- learning, through a reasoning-gym task's own verifier -------------------------------------------------------
TASK = "letter_e_test"
"""A procedural task registered with reasoning-gym for this test: its verifier scores the fraction of the reply's
characters that are "e", which the tiny model with a planted LM-head feature learns in a few rounds
(tests/test_learning.py says why that setting can learn and the plain tiny model cannot)."""


@dataclass
class LetterConfig:
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        assert self.size > 0, "size must be positive"


class LetterTask(ProceduralDataset):
    def __init__(self, config: LetterConfig) -> None:
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict:
        word = Random(self.seed + idx).choice(["tree", "green", "sleep", "bee", "deep"])
        return {"question": f"Say {word}.", "answer": word, "metadata": {"source_dataset": TASK, "source_index": idx}}

    def score_answer(self, answer: str | None, entry: dict) -> float:
        return answer.count("e") / len(answer) if answer else 0.0


if TASK not in DATASETS:
    register_dataset(TASK, LetterTask, LetterConfig)

LEARN = [
    "model=tiny",
    "model.source._target_=tests.test_learning.PlantedFeatureSource",
    "data=reasoning_gym",
    "reward=reasoning_gym",
    f"data.dataset.task={TASK}",
    "data.dataset.answer_format=plain",  # the whole reply is the answer the verifier scores
    "data.dataset.size=64",
    "trainer.max_epochs=8",
    "trainer.enable_progress_bar=false",
    "generator.max_new_tokens=12",
    "variant.num_generations=8",
    "data.prompts_per_round=2",
    "data.groups_per_micro_batch=2",
    "eval.enabled=false",
    "checkpoint.every_n_rounds=1000",
    "logging.samples_every_n_rounds=1000",
    "optim.optimizer.lr=1e-2",
]
WINDOW, MARGIN = 2, 0.05
"""As tests/test_learning.py: the mean reward of the last 2 rounds minus the first 2 must beat the control's by
0.05. Measured: gains of 0.098 (grpo) and 0.100 (storpo) against their controls' 0.004 and 0.012."""


def gain(tmp_path, *overrides: str) -> float:
    run = build_run(make_cfg(tmp_path, [*LEARN, *overrides]))
    run.fit()
    rewards = [r for _, r, _ in next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop)).history]
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


VARIANTS = {"grpo": ["variant=grpo"], "storpo": ["variant=storpo", "variant.min_steps=1"]}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_a_reasoning_gym_verifier_is_learnt_where_the_lr0_control_is_not(tmp_path, variant):
    trained = gain(tmp_path / "trained", *variant)
    control = gain(tmp_path / "control", *variant, "optim.optimizer.lr=0")
    assert trained > control + MARGIN, (trained, control)
