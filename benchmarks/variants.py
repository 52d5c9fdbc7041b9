"""GRPO against STORPO's arms at an equal budget of generated tokens: held-out pass@1 per generated token, over seeds.

Trains each arm (`--arms`, default all four) on the recipe's task (`--experiment`, default learn_arith) for each
seed: `grpo`; `storpo_text`, STORPO with sentence boundaries (a plain group where no initial completion has 2,
one flat advantage group); `storpo_token`, branch points at the most uncertain sampled tokens
(`variant.step_rule=uncertainty`) with the flat group; `storpo_tree`, the same branch points with each segment
credited V(end) - V(start) from samples that do not contain it (`variant.advantage=tree`). Every STORPO arm
samples a forest of 2 initial completions a prompt. Every run stops at the first round end at which
`rollout/tokens_generated_total` (every completion token sampled so far, dynamic sampling's dropped groups
included, a branch's shared prefix counted once) reaches the budget (`max_tokens_generated`), so every arm spends
the same generation compute, whatever each round costs it. Every setting the arms compare is pinned here
(PINNED, STORPO_PINNED, ARMS), composed, checked equal on every arm and printed before anything runs.

Writes into the output folder `variants.md` (printed too): the settings; per arm the tokens to reach the target
pass@1 (mean over seeds), the final pass@1 with the envelope of the seeds' 95% Wilson intervals, the share of
prompts branched (the lowest round of any seed, and the mean), the share of trained tokens whose advantage is not
0 (`rollout/credited_token_frac`) and the mean completion length; each arm against grpo paired by seed (the final
pass@1 difference per seed, its mean with a 95% t interval over the seeds, and how many seeds it won); a table per
run;
a warning when a STORPO arm hardly branched (its prompts then fall back to plain groups, and it trains as GRPO);
and `variants.png`: held-out pass@1 against generated tokens, mean over seeds with a min..max band.

    python benchmarks/variants.py                              # learn_arith, seeds 0 1 2, 50000 tokens
    python benchmarks/variants.py --arms grpo storpo_tree --budget 100000 --target 0.3 --seeds 0 1 2 3

Runs that finished before (a `final_metrics.json` in their folder) are read, not rerun (`--force` reruns).
Extra Hydra overrides after the options apply to every arm (and show in the printed settings).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from grpo_lightning.studies.analysis import EvalPoint, RunData, band, eval_points, read_run, tokens_to_target
from grpo_lightning.studies.jobs import Job, compose, run_jobs, value, wall_seconds

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
    "trainer.max_epochs": 1000,  # a cap only: the token budget ends every run first
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
"""Every STORPO arm's branching size: 2 trees a prompt, K = 2 continuations from each of up to 4 branch points
(docs/algorithm.md)."""
ARMS = {
    "grpo": {"variant": "grpo"},
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
STORPO_KEYS = ["variant._target_", *STORPO_PINNED, "variant.step_rule", "variant.fallback_rule", "variant.advantage"]


def hydra_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def pinned(budget: int, eval_every: int) -> dict[str, object]:
    return {**PINNED, "max_tokens_generated": budget, "eval.every_n_rounds": eval_every}


def arm_overrides(experiment: str, arm: str, shared: dict[str, object], extra: list[str]) -> list[str]:
    """A run's overrides, seed aside: the recipe, the shared pins, the arm's variant and pins, then `extra`."""
    own = dict(ARMS[arm])
    variant = own.pop("variant")
    own = {**(STORPO_PINNED if variant == "storpo" else GRPO_PINNED), **own}
    pins = [f"{k}={hydra_value(v)}" for k, v in {**shared, **own}.items()]
    return [f"experiment={experiment}", f"variant={variant}", *pins, *extra]


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

    @staticmethod
    def of(run: RunData) -> RunSummary:
        return RunSummary(
            wall_seconds(run.path),
            branched_per_round(run),
            mean_scalar(run, COMPLETION_LEN),
            mean_scalar(run, CREDITED),
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
        "| arm | seed | evaluations | tokens generated | pass@1 end [95% CI] | strict | format "
        f"| tokens to pass@1 {target:.3f} | prompts branched, lowest / mean round | trained tokens credited "
        "| completion tokens | wall min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, per_seed in points.items():
        for seed, evals in zip(seeds, per_seed, strict=True):
            e, reached, run = evals[-1], tokens_to_target(evals, target), runs[arm, seed]
            wall = None if run.wall_s is None else run.wall_s / 60
            lines.append(
                f"| {arm} | {seed} | {len(evals)} | {e.tokens:.0f} | {num(e.accuracy)} [{num(e.low)}, "
                f"{num(e.high)}] | {num(e.strict)} | {num(e.format_rate)} "
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
        counts = (sum(d > 0 for d in diffs), sum(d == 0 for d in diffs), sum(d < 0 for d in diffs))
        interval = t_interval(diffs)
        band = "n/a" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"
        lines.append(
            f"| {arm} | {', '.join(f'{d:+.3f}' for d in diffs)} | {sum(diffs) / len(diffs):+.3f} | {band} "
            f"| {' / '.join(map(str, counts))} |"
        )
    return "\n".join(lines)


def plot(points: dict[str, list[list[EvalPoint]]], target: float, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, per_seed in points.items():
        x, mean, low, high = band([[(p.tokens, p.accuracy) for p in evals] for evals in per_seed])
        (line,) = ax.plot(x, mean, marker="o", label=f"{arm} (mean of {len(per_seed)} seeds)")
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    ax.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
    ax.axvline(budget, color="gray", linestyle="--", label=f"budget {budget}")
    ax.set_xlabel("completion tokens generated")
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.set_title("pass@1 per generated token, band min..max over seeds")
    ax.legend(fontsize="small")
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
    """The tables after the settings: the target, per arm, paired by seed, per run; then the branching warnings."""
    rule = f"target pass@1: {target:.3f} ({target_note}); tokens to it: {TARGET_RULE}"
    parts = [rule, summary_table(points, seeds, runs, target)]
    paired = paired_table(points, seeds)
    if paired is not None:
        parts.append(paired)
    parts.append(runs_table(points, seeds, runs, target))
    return "\n\n".join([*parts, *branching_notes(runs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="learn_arith", help="the recipe whose task every arm trains on")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the arms to compare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=50_000, help="completion tokens generated per run")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many rounds")
    parser.add_argument("--target", type=float, default=None, help=f"pass@1 for tokens-to-target ({DEFAULT_TARGET})")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/variants"))
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm")
    args = parser.parse_args(argv)
    shared = pinned(args.budget, args.eval_every)
    overrides = {a: arm_overrides(args.experiment, a, shared, args.overrides) for a in args.arms}
    try:  # a missing recipe or a bad override fails now, not hours later
        configs = {a: compose(o) for a, o in overrides.items()}
    except ValueError as e:
        parser.error(str(e))
    check_equal(configs, list(shared))
    settings = settings_table(configs, [*shared, *GRPO_PINNED, *STORPO_KEYS])
    header = f"experiment={args.experiment}, seeds {args.seeds}, extra overrides {args.overrides}\n\n{settings}"
    print(header, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [Job(f"{a}_seed{seed}", (*overrides[a], f"seed={seed}")) for seed in args.seeds for a in args.arms]
    run_jobs(args.out, jobs, parallel=not args.sequential, force=args.force)
    data = {(a, s): read_run(args.out / f"{a}_seed{s}") for a in args.arms for s in args.seeds}
    points = {a: [eval_points(data[a, s]) for s in args.seeds] for a in args.arms}
    runs = {key: RunSummary.of(run) for key, run in data.items()}
    target, note = (args.target, "--target") if args.target is not None else (default_target(points), DEFAULT_TARGET)
    text = results(points, args.seeds, runs, target, note)
    print(text)
    (args.out / "variants.md").write_text(f"{header}\n\n{text}\n")
    plot(points, target, args.budget, args.out / "variants.png")
    print(f"wrote {args.out / 'variants.md'} and {args.out / 'variants.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
