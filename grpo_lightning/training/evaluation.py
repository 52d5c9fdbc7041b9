"""Evaluation during training, on any data source: greedy pass@1 with its 95% Wilson interval, and optionally the
unbiased pass@k from n samples per problem (Chen et al. 2021), on a fixed test subset.

What is scored (docs/data.md, "Evaluation"): an answer checker (`eval.checker`; null: the data source's own,
data/source.py) judges each reply. `eval/accuracy` reads the answer without regard to the format the prompt
asked for (the reply's last number for a numeric answer; for reasoning-gym, the task's verifier on that
reading), so a gain in it is a gain in answers, not in formatting; `eval/accuracy_strict` reads only the asked
format and `eval/format_rate` says how often the training reward found an answer. pass@k uses the
format-independent reading. A data source may keep accuracies of its own (GSM8K: `eval/gsm8k_accuracy`, its
reward's three formats, as logged before the checker existed), each with its interval.

The subset is a seeded permutation's first `num_problems` problems of the test split, so every evaluation of a
run (and every run of a sweep with the same `eval.seed`) scores the same problems. Evaluation uses the training
generator (HF now, vLLM when configured) and runs at the start, every `every_n_rounds` rounds, and at the end;
metrics go straight to the loggers at the current optimizer step. Under DDP each rank generates for every W-th
problem and the metrics are computed over all of them (rank 0 logs).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import lightning as L
import torch

from grpo_lightning.data.datamodule import encode_prompt
from grpo_lightning.data.games import GameSeeds
from grpo_lightning.distributed import gather_objects, rank_and_world
from grpo_lightning.rewards.base import AnswerChecker, Verdict
from grpo_lightning.rewards.checkers import GSM8KChecker
from grpo_lightning.schema import (
    Configured,
    boolean,
    check_settings,
    integer,
    optional,
    setting,
    target_class,
    text,
)
from grpo_lightning.training import tracking

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    format_rate: float
    completion_len_mean: float


def score_completions(texts: list[str], lengths: list[int], answers: list[str], reward_fn) -> EvalResult:
    """A GSM8K-style reward's own accuracy (`correct`) and format rate (an answer extracted), and the mean length:
    what `eval/gsm8k_accuracy` and `eval/format_rate` count on GSM8K (through `GSM8KChecker`).

    Plain means over the replies `evaluate` has already gathered from every rank: nothing synchronises again
    (a torchmetrics metric would all-gather its CPU state where the default group is NCCL, and fail).
    """
    checker = GSM8KChecker(reward_fn)
    verdicts = [checker.check(text, answer) for text, answer in zip(texts, answers, strict=True)]
    n = max(len(verdicts), 1)
    accuracy = sum(v.extras["gsm8k_accuracy"] for v in verdicts) / n
    return EvalResult(accuracy, sum(v.formatted for v in verdicts) / n, sum(lengths) / n)


def verdict_metrics(verdicts: list[Verdict]) -> dict[str, float]:
    """`eval/accuracy` with its Wilson interval, `eval/accuracy_strict`, `eval/format_rate`, and each of the
    verdicts' extra accuracies (`eval/<name>`) with its interval; every mean is over all replies."""
    n = max(len(verdicts), 1)
    metrics: dict[str, float] = {}
    columns = {"accuracy": [v.correct for v in verdicts]}
    columns |= {name: [v.extras[name] for v in verdicts] for name in (verdicts[0].extras if verdicts else {})}
    for name, column in columns.items():
        low, high = wilson_interval(sum(column), len(column))
        metrics |= {f"eval/{name}": sum(column) / n, f"eval/{name}_ci95_low": low, f"eval/{name}_ci95_high": high}
    metrics["eval/accuracy_strict"] = sum(v.strict for v in verdicts) / n
    metrics["eval/format_rate"] = sum(v.formatted for v in verdicts) / n
    return metrics


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), the chance that k of the n samples,
    drawn without replacement, hold a correct one. Computed as a product, which stays exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k(correct: list[list[bool]], k: int | None = None) -> float:
    """Mean unbiased pass@k over problems, each with its n sampled answers' correctness; k None: k = n (then it is
    the fraction of problems with a correct answer among their samples)."""
    if not correct:
        return 0.0
    return sum(pass_at_k_estimate(len(s), sum(s), k or len(s)) for s in correct) / len(correct)


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (Wilson 1927): unlike p +- z sqrt(p(1 - p) / n) it stays
    inside [0, 1] and is not empty at 0 or n successes, which small evaluation subsets often give."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class EvalSettings:
    """`eval`: greedy pass@1 on a fixed, seeded subset of the test split, with the training generator."""

    enabled: bool = setting(True, boolean)
    every_n_rounds: int = setting(12, integer(1))
    num_problems: int = setting(32, integer(1))
    pass_k: int = setting(0, integer(0))
    num_samples: int = setting(0, integer(0))
    max_new_tokens: int = setting(96, integer(1))
    max_prompt_tokens: int = setting(512, integer(1))
    num_samples_logged: int = setting(4, integer(0))
    replies_dir: str | None = setting(None, optional(text))
    at_start: bool = setting(True, boolean)
    seed: int = setting(1234, integer(0))
    batch_size: int = setting(64, integer(1))

    def __post_init__(self) -> None:
        check_settings(self, "eval")

    @staticmethod
    def joint_problems(values: dict, prefix: str) -> list[str]:
        """pass@k's two keys together (checked with the config, before anything loads)."""
        pass_k, samples = values.get("pass_k", 0), values.get("num_samples", 0)
        if pass_k and samples and samples < pass_k:
            return [f"{prefix}.num_samples ({samples}) must be >= {prefix}.pass_k ({pass_k}) or 0"]
        if samples and not pass_k:  # the samples would be drawn for no metric
            return [
                f"{prefix}.num_samples={samples} samples completions for eval/pass@k: set {prefix}.pass_k (1 to "
                f"{samples}) too, or {prefix}.num_samples=0"
            ]
        return []


def default_checker(dataset, reward=None) -> AnswerChecker:
    """The data source's own checker (`dataset.checker(reward)`); GSM8K's when there is no data source."""
    if dataset is not None:
        return dataset.checker(reward)
    return GSM8KChecker(reward) if reward is not None else GSM8KChecker()


class Evaluator(Configured, L.Callback):
    settings_types = (EvalSettings,)
    plays_games: ClassVar[bool] = False
    """Whether it evaluates by playing games (data=games) rather than by answering questions."""

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Games are evaluated by playing them: data=games takes the evaluator that plays."""
        source = target_class(cfg.data.dataset.get("_target_"))
        if cfg.eval.enabled and source is not None and issubclass(source, GameSeeds) and not cls.plays_games:
            raise ValueError(
                "eval._target_ must be grpo_lightning.training.game_evaluation.GameEvaluator with data=games (games "
                "are evaluated by playing; experiment=selfplay_tictactoe sets it), or set eval.enabled=false"
            )

    def __init__(self, dataset, reward=None, checker: AnswerChecker | None = None, generator=None, tokenizer=None,
                 **keys) -> None:  # fmt: skip
        """`dataset`: the test split (`eval.dataset`, any data source); `keys`: the `eval` node's (its settings
        types'). `checker` judges a reply; None: the source's own, `dataset.checker(reward)` (GSM8K's keeps
        `reward`'s correctness as eval/gsm8k_accuracy), or GSM8K's without a dataset. `generator` and `tokenizer`
        are the run's (train.py passes them with the config's keys); a dry run builds the evaluator without them, to
        check its keys."""
        self.settings, *self.own_settings = self.settings_from(keys)
        """The shared `eval` keys (`EvalSettings`); `own_settings`: a subclass's other settings types'."""
        self.num_samples = self.settings.num_samples or self.settings.pass_k
        """n, the samples drawn per problem for pass@k (Chen et al.'s estimator needs n >= k)."""
        self.dataset, self.checker = dataset, checker or default_checker(dataset, reward)
        self.generator, self.tokenizer = generator, tokenizer
        self.prompts: list = []
        self.final_metrics: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []
        """(optimizer step, metrics) of every evaluation of this run, a resumed run's earlier ones included."""
        self.last_replies: list[dict] = []
        """The latest evaluation's greedy replies, every rank's, in problem order: question, answer, completion
        and the verdict, for a researcher to read or re-score."""

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = [(step, dict(m)) for step, m in state_dict.get("history", [])]

    def at_fit_start(self, trainer: L.Trainer) -> None:
        """Called by the rollout loop once round 0 is sampled: load the subset, evaluate the starting policy."""
        if not self.settings.enabled:
            return
        problems = self.dataset.load()
        order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(self.settings.seed)).tolist()
        picked = order[: min(self.settings.num_problems, len(problems))]
        self.prompts = [
            encode_prompt(self.tokenizer, self.dataset, problems[i], i, self.settings.max_prompt_tokens) for i in picked
        ]
        if self.settings.at_start and trainer.ckpt_path is None:  # a resumed run was evaluated before its interruption
            self.evaluate(trainer)

    def after_round(self, trainer: L.Trainer, pl_module: L.LightningModule, last_round: bool = False) -> None:
        """Called by the rollout loop at the end of every round, once the next round is sampled; `last_round`:
        the run ends after this round before `trainer.max_epochs` (its token budget is spent)."""
        if self.is_due(trainer, pl_module, last_round):
            self.evaluate(trainer)

    def is_due(self, trainer: L.Trainer, pl_module: L.LightningModule, last_round: bool = False) -> bool:
        """Whether `after_round` evaluates now: every `every_n_rounds` rounds and after the last, unless the
        weights blew up (nothing worth scoring, or logging)."""
        rounds_done = trainer.current_epoch + 1
        last = last_round or (trainer.max_epochs is not None and rounds_done >= trainer.max_epochs)
        return (
            self.settings.enabled
            and not pl_module.diverged
            and (rounds_done % self.settings.every_n_rounds == 0 or last)
        )

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer) -> dict[str, float]:
        """Each rank judges its every W-th problem; the metrics are computed over all of them on every rank."""
        start = time.perf_counter()
        rank, world_size = rank_and_world()
        mine = self.prompts[rank::world_size]
        prefixes = [p.prompt_ids for p in mine]
        with (
            torch.random.fork_rng(),
            self.generator.sampling_session(),
            self.generator.rows_per_call(self.settings.batch_size),
        ):  # never moves the training RNG
            greedy = [c[0] for c in self.generator.generate(prefixes, 1, self.settings.max_new_tokens, greedy=True)]
            sampled = (
                self.generator.generate(prefixes, self.num_samples, self.settings.max_new_tokens)
                if self.settings.pass_k
                else []
            )
        texts = [self._decode(c.token_ids) for c in greedy]
        part = {  # judged here: a problem's record (a reasoning-gym verifier) never crosses processes
            "replies": [
                {"question": p.question, "answer": p.answer, "completion": text,
                 "verdict": self.checker.check(text, p.answer, p.record)}
                for p, text in zip(mine, texts, strict=True)
            ],
            "lengths": [len(c.token_ids) for c in greedy],
            "sampled_correct": [
                [self.checker.check(self._decode(c.token_ids), p.answer, p.record).correct for c in samples]
                for samples, p in zip(sampled, mine, strict=True)
            ]
            if self.settings.pass_k
            else [],
        }  # fmt: skip
        parts = gather_objects(part)
        replies, lengths, correct = ([x for q in parts for x in q[key]] for key in part)
        metrics = verdict_metrics([r["verdict"] for r in replies])
        metrics["eval/completion_len_mean"] = sum(lengths) / max(len(lengths), 1)
        if self.settings.pass_k:
            metrics[f"eval/pass@{self.settings.pass_k}"] = pass_at_k(correct, self.settings.pass_k)
        metrics["time/eval_s"] = max(gather_objects(time.perf_counter() - start))  # ranks decode in parallel
        self.record(trainer, metrics)
        if trainer.is_global_zero:
            self._log_table(trainer, replies)
            self._write_replies(trainer.global_step, replies)
        log.info("eval at step %d: accuracy %.3f on %d problems", trainer.global_step, metrics["eval/accuracy"],
                 len(replies))  # fmt: skip
        self.last_replies = replies
        return metrics

    def record(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        """An evaluation's metrics: to the loggers at the current optimizer step (rank 0), as `final_metrics`,
        and into the history the run summary reads."""
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step)
        self.final_metrics = metrics
        self.history.append((trainer.global_step, metrics))

    def _write_replies(self, step: int, replies: list[dict]) -> None:
        """`<eval.replies_dir>/step_<n>.jsonl`: one line per problem, in the subset's order (the same problems in
        the same order for every run with this `eval.seed`), so two runs can be compared problem by problem
        (a paired test, as benchmarks/learning.py does). Written atomically: a crash leaves the last whole file."""
        if self.settings.replies_dir is None:
            return
        folder = Path(self.settings.replies_dir)
        folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"question": r["question"], "answer": r["answer"], "completion": r["completion"],
                        "correct": r["verdict"].correct, "strict": r["verdict"].strict})
            for r in replies
        ]  # fmt: skip
        tmp = folder / f"step_{step}.jsonl.tmp"
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, folder / f"step_{step}.jsonl")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _log_table(self, trainer: L.Trainer, replies: list[dict]) -> None:
        def yes_no(flag: bool) -> str:
            return "yes" if flag else "no"

        columns = (
            tracking.Column("answer", max_chars=200),
            tracking.Column("correct"),
            tracking.Column("strict"),
            tracking.Column("completion", max_chars=1500),
        )
        rows = [
            (r["answer"], yes_no(r["verdict"].correct), yes_no(r["verdict"].strict), r["completion"])
            for r in replies[: self.settings.num_samples_logged]
        ]
        tracking.log_table(trainer.loggers, "eval/samples", tracking.Table(columns, tuple(rows)), trainer.global_step)


GSM8KEvaluator = Evaluator
"""The evaluator's name before it judged any data source (`eval._target_` of older configs)."""
