"""GRPO against STORPO's arms at an equal budget, of generated tokens or of optimizer steps: held-out pass@1 per
generated token and per optimizer step, over seeds.

Trains each arm (`--arms`, default `grpo storpo`) on the recipe's task (`--experiment`, default learn_arith) for
each seed: `grpo`; `storpo`, STORPO at the variant's defaults (conf/variant/storpo.yaml: 2 trees, K = 2
continuations from up to 2 branch points at the most uncertain tokens, each segment credited V(end) - V(start));
and three arms at up to 4 branch points, the setting of the measured comparison: `storpo_text`, sentence
boundaries (a plain group where no initial completion has 2, one flat advantage group); `storpo_token`, branch
points at the most uncertain sampled tokens (`variant.step_rule=uncertainty`) with the flat group; `storpo_tree`,
the same branch points with each segment credited from samples that do not contain it (`variant.advantage=tree`).
Every STORPO arm samples a forest of 2 initial completions a prompt. Every setting the arms compare is pinned
here (PINNED, STORPO_PINNED, ARMS), composed, checked equal on every arm and printed before anything runs.

Two budgets, one a run:
- generated tokens (the default, `--budget`): every run stops at the first round end at which
  `rollout/tokens_generated_total` (every completion token sampled so far, dynamic sampling's dropped groups
  included, a branch's shared prefix counted once) reaches `max_tokens_generated`, so every arm spends the same
  generation compute, whatever each round costs it; `trainer.max_epochs` is only a cap.
- optimizer steps (`--steps N`): every run trains N / S rounds (`trainer.max_epochs`), S being the optimizer steps
  a round takes, read from each arm's composed config (`optimizer_steps_per_round`: a round's micro-batches x
  `data.num_iterations` / `trainer.accumulate_grad_batches`; 1 with the pins); N must be a multiple of S, and the
  token budget is off. S is fixed before the run for every arm, STORPO included: a STORPO group is one prompt's
  forest, and dynamic sampling fills a short round with dropped groups, so a round's micro-batches do not depend
  on its rollouts. Not `trainer.max_steps`: the config takes it (`+trainer.max_steps=N`; a Trainer argument
  passes through), but the rollout loop and the evaluator count rounds. At Lightning's stop the loop still samples
  a next round that is never trained (it asks `trainer.max_epochs` and `trainer.should_stop`, which max_steps
  leaves unset), the evaluation after the last round (due at `trainer.max_epochs` or the token budget) does not
  run, and a stop inside a round drops the rest of its steps. Whole rounds end like any last round: evaluated,
  checkpointed, exported.

Writes into the output folder `variants.md` (printed too): the settings and the budget; per arm the tokens to reach
the target pass@1 (mean over seeds), the final pass@1 with the envelope of the seeds' 95% Wilson intervals, the
share of prompts branched (the lowest round of any seed, and the mean), the share of trained tokens whose advantage
is not 0 (`rollout/credited_token_frac`) and the mean completion length; each arm against grpo paired by seed (the
final pass@1 difference per seed, and the pass@1 gained from the start per 10,000 generated tokens and per
optimizer step: each difference per seed, its mean with a 95% t interval over the seeds, and how many seeds the
arm won); a table per run with both budgets as spent (tokens generated, optimizer steps made); a warning when a
STORPO arm hardly branched (its prompts then fall back to plain groups, and it trains as GRPO); and `variants.png`:
held-out pass@1 against generated tokens and against optimizer steps, mean over seeds with a min..max band.

    python benchmarks/variants.py                                  # grpo, storpo; seeds 0 1 2; 50000 tokens
    python benchmarks/variants.py --steps 20                       # the same arms at 20 optimizer steps a run
    python benchmarks/variants.py --arms grpo storpo_tree --budget 100000 --target 0.3 --seeds 0 1 2 3

Runs that finished before (a `final_metrics.json` in their folder) are read, not rerun (`--force` reruns), unless
their recorded overrides (`.hydra/overrides.yaml`) are not the ones this comparison gives them; the two budgets
write to different folders by default (`benchmarks/results/variants`, `benchmarks/results/variants_steps`).
Extra Hydra overrides after the options apply to every arm (and show in the printed settings).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_lightning.studies.analysis import (
    EVAL_TAGS,
    TOKENS,
    EvalPoint,
    RunData,
    band,
    eval_points,
    read_run,
    tokens_to_target,
)
from grpo_lightning.studies.jobs import Job, cli_command, compose, finished, run_jobs, value, wall_seconds
from grpo_lightning.training.overlap import optimizer_steps_per_round

PINNED = {
    "generator.temperature": 0.7,
    "generator.top_p": 1.0,
    "generator.top_k": 0,
    "generator.max_new_tokens": 48,  # STORPO's continuations get what the branch point leaves of it
    "data.prompts_per_round": 16,  # the recipe's: at 4, pass@1 swung by 0.1 between evaluations
    "data.groups_per_micro_batch": 1,
    "data.num_iterations": 1,
    "data.dynamic_sampling.enabled": True,  # a STORPO group is one prompt's tree: filtered alike
    "data.dynamic_sampling.max_extra_batches": 1,
    "trainer.accumulate_grad_batches": None,  # one optimizer step per round
    "loss.loss_type": "grpo",
    "loss.beta": 0.0,
    "loss.epsilon_low": 0.2,
    "loss.epsilon_high": 0.28,
    "optim.optimizer.lr": 5.0e-4,
    "optim.schedule.kind": "constant",  # a decaying schedule would depend on the round cap, not the budget
    "optim.schedule.warmup_steps": 1,
    "trainer.max_epochs": 1000,  # a cap only: the token budget ends every run first (`--steps` sets the rounds)
    "eval.at_start": True,
    "eval.num_problems": 128,
    "eval.seed": 1234,
}
"""Settings every arm gets, set explicitly (the budget and eval.every_n_rounds come from the options)."""
GRPO_PINNED = {"variant.num_generations": 8}
"""GRPO's group size G (the variant owns it)."""
STORPO_PINNED = {
    "variant.fallback_generations": 8,  # the group of a prompt STORPO samples plainly: GRPO's G
    "variant.trees": 2,
    "variant.completions_per_step": 2,
    "variant.min_steps": 2,
    "variant.max_steps": 4,
    "variant.min_gap": 4,
}
"""Every STORPO arm's branching size unless its arm says otherwise: 2 trees a prompt, K = 2 continuations from each
of up to 4 branch points (docs/algorithm.md); the `storpo` arm takes the variant's 2."""
ARMS = {
    "grpo": {"variant": "grpo"},
    "storpo": {  # the variant's defaults (conf/variant/storpo.yaml), each pinned
        "variant": "storpo",
        "variant.max_steps": 2,
        "variant.step_rule": "uncertainty",
        "variant.fallback_rule": "uncertainty",
        "variant.advantage": "tree",
    },
    "storpo_text": {
        "variant": "storpo",
        "variant.step_rule": "sentence",
        "variant.fallback_rule": "none",
        "variant.advantage": "group",
    },
    "storpo_token": {"variant": "storpo", "variant.step_rule": "uncertainty", "variant.advantage": "group"},
    "storpo_tree": {"variant": "storpo", "variant.step_rule": "uncertainty", "variant.advantage": "tree"},
}
"""What each arm is: its variant and the settings that tell its STORPO apart."""
DEFAULT_ARMS = ["grpo", "storpo"]
"""GRPO against STORPO at the variant's defaults; the arms at 4 branch points by name (`--arms`)."""
STORPO_KEYS = ["variant._target_", *STORPO_PINNED, "variant.step_rule", "variant.fallback_rule", "variant.advantage"]
DEFAULT_OUT = {"tokens": Path("benchmarks/results/variants"), "steps": Path("benchmarks/results/variants_steps")}
"""The output folder of each budget: runs of one are never read back as runs of the other."""


def hydra_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def pinned(budget: int, eval_every: int) -> dict[str, object]:
    """The shared pins at a budget of `budget` generated tokens a run."""
    return {**PINNED, "max_tokens_generated": budget, "eval.every_n_rounds": eval_every}


def pinned_rounds(rounds: int, eval_every: int) -> dict[str, object]:
    """The shared pins at a budget of optimizer steps: `rounds` rounds a run (`rounds_for_steps`), no token budget."""
    return {**PINNED, "trainer.max_epochs": rounds, "max_tokens_generated": None, "eval.every_n_rounds": eval_every}


def arm_overrides(experiment: str, arm: str, shared: dict[str, object], extra: list[str]) -> list[str]:
    """A run's overrides, seed aside: the recipe, the shared pins, the arm's variant and pins, then `extra`."""
    own = dict(ARMS[arm])
    variant = own.pop("variant")
    own = {**(STORPO_PINNED if variant == "storpo" else GRPO_PINNED), **own}
    pins = [f"{k}={hydra_value(v)}" for k, v in {**shared, **own}.items()]
    return [f"experiment={experiment}", f"variant={variant}", *pins, *extra]


def steps_per_round(cfg: DictConfig) -> int:
    """The optimizer steps one round of this composed config takes (`optimizer_steps_per_round`, over every
    process: trainer.devices x trainer.num_nodes); ValueError when it cannot be known before the run."""
    devices, nodes = value(cfg, "trainer.devices"), value(cfg, "trainer.num_nodes") or 1
    if OmegaConf.is_list(devices):
        world = len(devices) * int(nodes)
    elif str(devices).isdigit() and int(devices) >= 1:  # not -1 or auto: counted only at the run
        world = int(devices) * int(nodes)
    else:
        raise ValueError(f"--steps needs trainer.devices as a count or a list of devices (got {devices})")
    steps = optimizer_steps_per_round(
        value(cfg, "data.prompts_per_round"),
        value(cfg, "data.groups_per_micro_batch"),
        value(cfg, "data.num_iterations"),
        value(cfg, "trainer.accumulate_grad_batches"),
        world,
    )
    if steps is None:
        raise ValueError(
            "the optimizer steps a round takes do not divide out (data.prompts_per_round, "
            "data.groups_per_micro_batch, data.num_iterations, trainer.accumulate_grad_batches)"
        )
    return steps


def rounds_for_steps(configs: dict[str, DictConfig], steps: int) -> tuple[int, int]:
    """(rounds, steps a round) that make `steps` optimizer steps on every arm; ValueError when the arms' rounds
    take different numbers of steps or `steps` is not a whole number of rounds."""
    per_round = {arm: steps_per_round(cfg) for arm, cfg in configs.items()}
    if len(set(per_round.values())) > 1:
        raise ValueError(f"the arms' rounds take different numbers of optimizer steps: {per_round}")
    (each,) = set(per_round.values())
    if steps < 1 or steps % each:
        raise ValueError(f"--steps {steps}: not a positive multiple of the {each} optimizer steps a round takes")
    return steps // each, each


def settings_table(configs: dict[str, DictConfig], keys: list[str]) -> str:
    """The compared settings as each arm's composed config has them."""
    lines = [f"| setting | {' | '.join(configs)} |", "|---|" + "---|" * len(configs)]
    for key in keys:
        values = [value(cfg, key) for cfg in configs.values()]
        lines.append(f"| `{key}` | " + " | ".join(f"`{hydra_value(v)}`" for v in values) + " |")
    return "\n".join(lines)


def check_equal(configs: dict[str, DictConfig], keys: list[str]) -> None:
    for key in keys:
        values = {name: value(cfg, key) for name, cfg in configs.items()}
        if len({hydra_value(v) for v in values.values()}) > 1:
            raise SystemExit(f"{key} differs between the arms: {values}")


def check_budget(configs: dict[str, DictConfig], budget: dict[str, object]) -> None:
    """The budget's keys as the budget sets them on every arm: an extra override that changed one would compare
    the arms at another budget than the one printed."""
    for name, cfg in configs.items():
        for key, want in budget.items():
            if hydra_value(value(cfg, key)) != hydra_value(want):
                raise SystemExit(
                    f"{key} is {hydra_value(value(cfg, key))} on {name}; the budget sets {hydra_value(want)} "
                    "(drop the extra override that changes it)"
                )


def check_reusable(out: Path, jobs: list[Job]) -> None:
    """Finished runs in `out` that ran with other overrides than their job's (`.hydra/overrides.yaml`, as the run
    recorded them): read back, they would enter the tables as runs of this comparison. A folder without the record
    is read as it is."""
    stale = []
    for job in jobs:
        run_dir = out / job.name
        record = run_dir / ".hydra" / "overrides.yaml"
        if not finished(run_dir) or not record.is_file():
            continue
        expected = {o for o in cli_command(job, run_dir)[3:] if not o.startswith("hydra.")}
        if {str(o) for o in OmegaConf.load(record)} != expected:
            stale.append(job.name)
    if stale:
        raise SystemExit(
            f"{', '.join(stale)} in {out} finished with other overrides than this comparison gives them (another "
            "budget, arm or pin); rerun them with --force, or write to another --out"
        )


DEFAULT_TARGET = "default: halfway from the mean start to the lowest arm's mean final"


def default_target(points: dict[str, list[list[EvalPoint]]]) -> float:
    """Halfway from the mean start pass@1 (all runs) to the lowest of the arms' mean final pass@1: a level every
    arm's mean reaches, so the table compares how fast."""
    starts = [runs[0].accuracy for per_seed in points.values() for runs in per_seed]
    finals = [sum(runs[-1].accuracy for runs in per_seed) / len(per_seed) for per_seed in points.values()]
    start = sum(starts) / len(starts)
    return start + (min(finals) - start) / 2


def mean_or_none(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def signed(x: float, digits: int) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.{digits}f}"


def branched_per_round(run: RunData) -> list[float] | None:
    """The share of its prompts a STORPO run branched from, each round (1 - `rollout/storpo_fallback_frac`); None
    for a run that does not log it (GRPO). A prompt whose initial completion gave no branch point (a text rule's
    too few boundaries with `fallback_rule=none`, or a one-token completion) is sampled as a plain group: near 0,
    the run trained on plain GRPO groups, and the comparison says nothing about branching."""
    fallback = run.scalars.get("rollout/storpo_fallback_frac")
    return None if not fallback else [1.0 - v for _, v in sorted(fallback)]


def mean_scalar(run: RunData, tag: str) -> float | None:
    """A scalar's mean over the run's rounds; None when it was not logged."""
    values = [v for _, v in run.scalars.get(tag, [])]
    return sum(values) / len(values) if values else None


def steps_made(run: RunData) -> int | None:
    """The optimizer steps the run made (Lightning's global step at its end; a step the non-finite guard skipped
    counts): a round's metrics are logged at its last step, global step - 1 at its end, and the evaluation after it
    at the global step (`eval_points`), so the larger of the last round's step + 1 and the last evaluation's step.
    None for a run that logged neither."""
    rounds = [step for step, _ in run.scalars.get(TOKENS, [])]
    evals = [step for step, _ in run.scalars.get(EVAL_TAGS["accuracy"], [])]
    ends = ([max(rounds) + 1] if rounds else []) + ([max(evals)] if evals else [])
    return max(ends, default=None)


FEW_BRANCHES = 0.1
"""Below this mean share of prompts branched, the results say that the comparison did not test branching."""


@dataclass(frozen=True)
class RunSummary:
    """What the tables need of one run beside its evaluations."""

    wall_s: float | None
    branched: list[float] | None
    """Share of prompts branched, each round (None: not a STORPO run)."""
    completion_len: float | None
    """Mean completion tokens over the rounds (a continuation counted with its shared prefix)."""
    credited: float | None
    """Mean over the rounds of the share of trained tokens whose advantage is not 0."""
    steps: int | None
    """Optimizer steps made (`steps_made`)."""

    @staticmethod
    def of(run: RunData) -> RunSummary:
        return RunSummary(
            wall_seconds(run.path),
            branched_per_round(run),
            mean_scalar(run, COMPLETION_LEN),
            mean_scalar(run, CREDITED),
            steps_made(run),
        )


COMPLETION_LEN = "rollout/completion_len_mean"
CREDITED = "rollout/credited_token_frac"
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Student's t, 0.975 quantile, by degrees of freedom: the paired difference's 95% interval over the seeds."""


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """The 95% interval of the mean of `values` (Student's t with n - 1 degrees of freedom); None below 2 values
    or beyond the table."""
    n = len(values)
    if n < 2 or n - 1 not in T_975:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T_975[n - 1] * sd / math.sqrt(n)
    return mean - half, mean + half


def branched_cell(rounds: list[float] | None) -> str:
    """`lowest / mean` share of prompts branched over the rounds ("n/a" for GRPO)."""
    return "n/a" if rounds is None else f"{min(rounds):.3f} / {sum(rounds) / len(rounds):.3f}"


def runs_table(points: dict[str, list[list[EvalPoint]]], seeds: list[int], runs: dict, target: float) -> str:
    lines = [
        "| arm | seed | evaluations | tokens generated | optimizer steps | pass@1 end [95% CI] | strict | format "
        f"| tokens to pass@1 {target:.3f} | prompts branched, lowest / mean round | trained tokens credited "
        "| completion tokens | wall min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, per_seed in points.items():
        for seed, evals in zip(seeds, per_seed, strict=True):
            e, reached, run = evals[-1], tokens_to_target(evals, target), runs[arm, seed]
            wall = None if run.wall_s is None else run.wall_s / 60
            lines.append(
                f"| {arm} | {seed} | {len(evals)} | {e.tokens:.0f} | {'n/a' if run.steps is None else run.steps} "
                f"| {num(e.accuracy)} [{num(e.low)}, {num(e.high)}] | {num(e.strict)} | {num(e.format_rate)} "
                f"| {'not reached' if reached is None else f'{reached:.0f}'} | {branched_cell(run.branched)} "
                f"| {num(run.credited)} | {num(run.completion_len, 1)} | {num(wall, 1)} |"
            )
    return "\n".join(lines)


def summary_table(points: dict[str, list[list[EvalPoint]]], seeds: list[int], runs: dict, target: float) -> str:
    """Per arm: tokens to the target (mean over seeds; "not reached" unless every seed reached it), the final
    pass@1 (mean over seeds) with the envelope of the seeds' 95% Wilson intervals, the share of prompts branched
    (its lowest round over all seeds, and its mean), the mean completion tokens."""
    lines = [
        f"| arm | seeds | tokens to pass@1 {target:.3f}, mean | final pass@1, mean | 95% interval (envelope "
        "of the seeds' Wilson intervals) | prompts branched, lowest / mean round | trained tokens credited, mean "
        "| completion tokens, mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, per_seed in points.items():
        reached = [tokens_to_target(evals, target) for evals in per_seed]
        mean = mean_or_none(reached)
        n_reached = sum(r is not None for r in reached)
        tokens = f"{mean:.0f}" if mean is not None else f"not reached ({n_reached} of {len(reached)} seeds did)"
        final = sum(evals[-1].accuracy for evals in per_seed) / len(per_seed)
        low, high = min(evals[-1].low for evals in per_seed), max(evals[-1].high for evals in per_seed)
        rounds = [runs[arm, s].branched for s in seeds]
        branched = None if any(r is None for r in rounds) else [v for r in rounds for v in r]
        lengths = mean_or_none([runs[arm, s].completion_len for s in seeds])
        credited = mean_or_none([runs[arm, s].credited for s in seeds])
        lines.append(
            f"| {arm} | {len(per_seed)} | {tokens} | {num(final)} | [{num(low)}, {num(high)}] "
            f"| {branched_cell(branched)} | {num(credited)} | {num(lengths, 1)} |"
        )
    return "\n".join(lines)


def paired_cells(diffs: list[float], digits: int) -> str:
    """A paired comparison's cells: the difference per seed, its mean, the mean's 95% t interval over the seeds,
    and the seeds on which the arm was higher / level / lower."""
    counts = (sum(d > 0 for d in diffs), sum(d == 0 for d in diffs), sum(d < 0 for d in diffs))
    interval = t_interval(diffs)
    band = "n/a" if interval is None else f"[{signed(interval[0], digits)}, {signed(interval[1], digits)}]"
    per_seed = ", ".join(signed(d, digits) for d in diffs)
    return f"{per_seed} | {signed(sum(diffs) / len(diffs), digits)} | {band} | {' / '.join(map(str, counts))} |"


def paired_table(points: dict[str, list[list[EvalPoint]]], seeds: list[int], baseline: str = "grpo") -> str | None:
    """Each arm against `baseline`, paired by seed (the same seed draws the same prompts and evaluation set): the
    final pass@1 difference per seed, its mean, and the seeds on which the arm ended higher / level / lower."""
    if baseline not in points or len(points) < 2:
        return None
    lines = [
        f"| arm - {baseline} | final pass@1 difference per seed ({', '.join(map(str, seeds))}) | mean difference "
        "| its 95% t interval over the seeds | seeds higher / level / lower |",
        "|---|---|---|---|---|",
    ]
    base = [evals[-1].accuracy for evals in points[baseline]]
    for arm, per_seed in points.items():
        if arm == baseline:
            continue
        diffs = [evals[-1].accuracy - b for evals, b in zip(per_seed, base, strict=True)]
        lines.append(f"| {arm} | {paired_cells(diffs, 3)}")
    return "\n".join(lines)


PER_TOKENS = 10_000
"""The token unit of the gain per generated token."""


def gain(evals: list[EvalPoint]) -> float:
    """Held-out pass@1 gained over the run: the last evaluation's less the start-of-run one (NaN without one)."""
    return evals[-1].accuracy - evals[0].accuracy if evals[0].step == 0 else math.nan


def gain_rates(evals: list[EvalPoint], steps: int | None) -> dict[str, float]:
    """The run's pass@1 gain per PER_TOKENS generated tokens and per optimizer step (NaN where the run spent none)."""
    tokens = evals[-1].tokens
    return {
        f"{PER_TOKENS:,} generated tokens": gain(evals) / tokens * PER_TOKENS if tokens > 0 else math.nan,
        "optimizer step": gain(evals) / steps if steps else math.nan,
    }


def rate_table(
    points: dict[str, list[list[EvalPoint]]], seeds: list[int], runs: dict, baseline: str = "grpo"
) -> str | None:
    """Each arm against `baseline`, paired by seed, on each budget's axis: the difference of the pass@1 gained from
    the start per PER_TOKENS generated tokens, and per optimizer step. At either budget one axis is the one the
    arms were held equal on and the other shows what that costs (a STORPO round spends more tokens on a step)."""
    if baseline not in points or len(points) < 2:
        return None
    lines = [
        f"| arm - {baseline} | pass@1 gained from the start, per | difference per seed "
        f"({', '.join(map(str, seeds))}) | mean difference | its 95% t interval over the seeds "
        "| seeds higher / level / lower |",
        "|---|---|---|---|---|---|",
    ]

    def rates(arm: str) -> list[dict[str, float]]:
        return [gain_rates(evals, runs[arm, s].steps) for s, evals in zip(seeds, points[arm], strict=True)]

    base = rates(baseline)
    for arm in points:
        if arm == baseline:
            continue
        own = rates(arm)
        for unit in base[0]:
            diffs = [o[unit] - b[unit] for o, b in zip(own, base, strict=True)]
            lines.append(f"| {arm} | {unit} | {paired_cells(diffs, 4)}")
    return "\n".join(lines)


def plot(
    points: dict[str, list[list[EvalPoint]]], target: float, path: Path, tokens: int | None, steps: int | None
) -> None:
    """Held-out pass@1 against generated tokens (left) and optimizer steps (right), the budget marked on its axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, (axis, label, budget) in zip(
        axes, (("tokens", "completion tokens generated", tokens), ("step", "optimizer steps", steps)), strict=True
    ):
        for arm, per_seed in points.items():
            x, mean, low, high = band([[(getattr(p, axis), p.accuracy) for p in evals] for evals in per_seed])
            (line,) = ax.plot(x, mean, marker="o", label=f"{arm} (mean of {len(per_seed)} seeds)")
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
        ax.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
        if budget is not None:
            ax.axvline(budget, color="gray", linestyle="--", label=f"budget {budget}")
        ax.set_xlabel(label)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("held-out pass@1 (greedy)")
    fig.suptitle("pass@1 per generated token and per optimizer step, band min..max over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


TARGET_RULE = (
    "linear interpolation between the last evaluation below the target and the first at or above it "
    "(0 when the start is already there)"
)


def branching_notes(runs: dict) -> list[str]:
    """A warning for each STORPO arm that branched from fewer than FEW_BRANCHES of its prompts, on average."""
    notes = []
    for arm in dict.fromkeys(a for a, _ in runs):
        rounds = [runs[key].branched for key in runs if key[0] == arm]
        if any(r is None for r in rounds):
            continue
        mean = mean_or_none([sum(r) / len(r) for r in rounds])
        if mean is not None and mean < FEW_BRANCHES:
            notes.append(
                f"{arm} branched from {mean:.1%} of its prompts (mean over runs and rounds): the other initial "
                "completions gave no branch point, so their prompts were sampled as plain groups. It trained on GRPO "
                "groups; its comparison does not test branching."
            )
    return notes


def results(points, seeds: list[int], runs: dict, target: float, target_note: str) -> str:
    """The tables after the settings: the target, per arm, paired by seed (final pass@1, then the gain per token and
    per step), per run; then the branching warnings."""
    rule = f"target pass@1: {target:.3f} ({target_note}); tokens to it: {TARGET_RULE}"
    parts = [rule, summary_table(points, seeds, runs, target)]
    for table in (paired_table(points, seeds), rate_table(points, seeds, runs)):
        if table is not None:
            parts.append(table)
    parts.append(runs_table(points, seeds, runs, target))
    return "\n\n".join([*parts, *branching_notes(runs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="learn_arith", help="the recipe whose task every arm trains on")
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS), help="the arms to compare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--budget", type=int, default=50_000, help="completion tokens generated per run (the default budget: 50000)"
    )
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps per run, instead of a token budget")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many rounds")
    parser.add_argument("--target", type=float, default=None, help=f"pass@1 for tokens-to-target ({DEFAULT_TARGET})")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: benchmarks/results/variants, with --steps variants_steps)",
    )
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm")
    args = parser.parse_args(argv)
    out = args.out or DEFAULT_OUT["tokens" if args.steps is None else "steps"]
    shared = pinned(args.budget, args.eval_every)
    try:  # a missing recipe, a bad override or a step budget that is no whole number of rounds fails now
        configs = {a: compose(arm_overrides(args.experiment, a, shared, args.overrides)) for a in args.arms}
        if args.steps is None:
            spent = {"max_tokens_generated": args.budget}
            budget_line = f"budget: {args.budget} generated tokens a run (max_tokens_generated)"
        else:
            rounds, each = rounds_for_steps(configs, args.steps)
            shared = pinned_rounds(rounds, args.eval_every)
            configs = {a: compose(arm_overrides(args.experiment, a, shared, args.overrides)) for a in args.arms}
            spent = {"trainer.max_epochs": rounds, "max_tokens_generated": None}
            budget_line = f"budget: {args.steps} optimizer steps a run ({rounds} rounds of {each}, trainer.max_epochs)"
    except ValueError as e:
        parser.error(str(e))
    check_equal(configs, list(shared))
    check_budget(configs, spent)
    settings = settings_table(configs, [*shared, *GRPO_PINNED, *STORPO_KEYS])
    header = (
        f"experiment={args.experiment}, seeds {args.seeds}, extra overrides {args.overrides}\n\n{budget_line}\n\n"
        f"{settings}"
    )
    print(header, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    overrides = {a: arm_overrides(args.experiment, a, shared, args.overrides) for a in args.arms}
    jobs = [Job(f"{a}_seed{seed}", (*overrides[a], f"seed={seed}")) for seed in args.seeds for a in args.arms]
    if not args.force:
        check_reusable(out, jobs)
    run_jobs(out, jobs, parallel=not args.sequential, force=args.force)
    data = {(a, s): read_run(out / f"{a}_seed{s}") for a in args.arms for s in args.seeds}
    points = {a: [eval_points(data[a, s]) for s in args.seeds] for a in args.arms}
    runs = {key: RunSummary.of(run) for key, run in data.items()}
    target, note = (args.target, "--target") if args.target is not None else (default_target(points), DEFAULT_TARGET)
    text = results(points, args.seeds, runs, target, note)
    print(text)
    (out / "variants.md").write_text(f"{header}\n\n{text}\n")
    plot(points, target, out / "variants.png", args.budget if args.steps is None else None, args.steps)
    print(f"wrote {out / 'variants.md'} and {out / 'variants.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
