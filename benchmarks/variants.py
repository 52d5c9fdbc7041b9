"""GRPO against STORPO at an equal budget of generated tokens: held-out pass@1 per generated token, over seeds.

Trains `variant=grpo` and `variant=storpo` on the recipe's task (`--experiment`, default learn_arith) for each
seed. Every run stops at the first round end at which `rollout/tokens_generated_total` (every completion token
sampled so far, dynamic sampling's dropped groups and STORPO's continuations included) reaches the budget
(`max_tokens_generated`), so both variants spend the same generation compute, whatever each round costs them.
Every setting the two sides compare is pinned here (PINNED, STORPO_PINNED), composed, checked equal on both
sides and printed before anything runs. Writes into the output folder `variants.md` (printed too): the
settings, a table per run (final pass@1 with its 95% Wilson interval, strict accuracy, format rate, tokens,
tokens to the target, the share of prompts STORPO branched from, wall time) and per variant (tokens to reach the
target pass@1, mean over seeds; the final pass@1), a warning when STORPO hardly branched (its prompts then fall
back to plain groups, and the two sides train alike), and `variants.png`: held-out pass@1 against generated
tokens, mean over seeds with a min..max band.

    python benchmarks/variants.py                              # learn_arith, seeds 0 1 2, 50000 tokens
    python benchmarks/variants.py --budget 100000 --target 0.3 --seeds 0 1 2 3

Runs that finished before (a `final_metrics.json` in their folder) are read, not rerun (`--force` reruns).
Extra Hydra overrides after the options apply to both variants (and show in the printed settings).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from omegaconf import DictConfig

from grpo_lightning.app.analysis import EvalPoint, RunData, band, eval_points, read_run, tokens_to_target
from grpo_lightning.app.jobs import Job, compose, run_jobs, value, wall_seconds

VARIANTS = ("grpo", "storpo")
PINNED = {
    "generator.num_generations": 8,  # G: GRPO's group size, and STORPO's for a prompt it samples plainly
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
"""Settings both variants get, set explicitly (the budget and eval.every_n_rounds come from the options)."""
STORPO_PINNED = {
    "variant.completions_per_step": 2,
    "variant.min_steps": 2,
    "variant.max_steps": 4,
    "variant.step_rule": "sentence",
}
"""STORPO's own settings: K continuations from each of 2 to 4 branch points, steps ending at sentences
(docs/algorithm.md)."""


def hydra_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def pinned(budget: int, eval_every: int) -> dict[str, object]:
    return {**PINNED, "max_tokens_generated": budget, "eval.every_n_rounds": eval_every}


def variant_overrides(experiment: str, variant: str, shared: dict[str, object], extra: list[str]) -> list[str]:
    """A run's overrides, seed aside: the recipe, the shared pins, the variant and its pins, then `extra`."""
    own = STORPO_PINNED if variant == "storpo" else {}
    pins = [f"{k}={hydra_value(v)}" for k, v in {**shared, **own}.items()]
    return [f"experiment={experiment}", f"variant={variant}", *pins, *extra]


def settings_table(configs: dict[str, DictConfig], keys: list[str]) -> str:
    """The compared settings as each variant's composed config has them; exits if a shared one differs."""
    lines = [f"| setting | {' | '.join(configs)} |", "|---|" + "---|" * len(configs)]
    for key in keys:
        values = [value(cfg, key) for cfg in configs.values()]
        lines.append(f"| `{key}` | " + " | ".join(f"`{hydra_value(v)}`" for v in values) + " |")
    return "\n".join(lines)


def check_equal(configs: dict[str, DictConfig], keys: list[str]) -> None:
    for key in keys:
        values = {name: value(cfg, key) for name, cfg in configs.items()}
        if len({hydra_value(v) for v in values.values()}) > 1:
            raise SystemExit(f"{key} differs between the variants: {values}")


DEFAULT_TARGET = "default: halfway from the mean start to the lower variant's mean final"


def default_target(points: dict[str, list[list[EvalPoint]]]) -> float:
    """Halfway from the mean start pass@1 (all runs) to the lower of the variants' mean final pass@1: a level
    both variants' means reach, so the table compares how fast."""
    starts = [runs[0].accuracy for per_seed in points.values() for runs in per_seed]
    finals = [sum(runs[-1].accuracy for runs in per_seed) / len(per_seed) for per_seed in points.values()]
    start = sum(starts) / len(starts)
    return start + (min(finals) - start) / 2


def mean_or_none(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def branched_fraction(run: RunData) -> float | None:
    """The share of its prompts a STORPO run branched from, mean over rounds (1 - `rollout/storpo_fallback_frac`);
    None for a run that does not log it (GRPO). A prompt whose initial completion has fewer than
    `variant.min_steps` step boundaries is sampled as a plain group: near 0, the STORPO run trained on plain GRPO
    groups, and the comparison says nothing about branching."""
    fallback = run.scalars.get("rollout/storpo_fallback_frac")
    return None if not fallback else 1.0 - sum(v for _, v in fallback) / len(fallback)


FEW_BRANCHES = 0.1
"""Below this mean share of prompts branched, the results say that the comparison did not test branching."""


def runs_table(
    points: dict[str, list[list[EvalPoint]]], seeds: list[int], walls: dict, branched: dict, target: float
) -> str:
    lines = [
        "| variant | seed | evaluations | tokens generated | pass@1 end [95% CI] | strict | format "
        f"| tokens to pass@1 {target:.3f} | prompts branched | wall min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, per_seed in points.items():
        for seed, runs in zip(seeds, per_seed, strict=True):
            e, reached = runs[-1], tokens_to_target(runs, target)
            lines.append(
                f"| {variant} | {seed} | {len(runs)} | {e.tokens:.0f} | {num(e.accuracy)} [{num(e.low)}, "
                f"{num(e.high)}] | {num(e.strict)} | {num(e.format_rate)} "
                f"| {'not reached' if reached is None else f'{reached:.0f}'} | {num(branched[variant, seed])} "
                f"| {num(walls[variant, seed] / 60, 1)} |"
            )
    return "\n".join(lines)


def summary_table(points: dict[str, list[list[EvalPoint]]], target: float) -> str:
    """Per variant: tokens to the target (mean over seeds; "not reached" unless every seed reached it), the
    final pass@1 (mean over seeds) with the envelope of the seeds' 95% Wilson intervals."""
    lines = [
        f"| variant | seeds | tokens to pass@1 {target:.3f}, mean | final pass@1, mean | 95% interval (envelope "
        "of the seeds' Wilson intervals) |",
        "|---|---|---|---|---|",
    ]
    for variant, per_seed in points.items():
        reached = [tokens_to_target(runs, target) for runs in per_seed]
        mean = mean_or_none(reached)
        n_reached = sum(r is not None for r in reached)
        tokens = f"{mean:.0f}" if mean is not None else f"not reached ({n_reached} of {len(reached)} seeds did)"
        final = sum(runs[-1].accuracy for runs in per_seed) / len(per_seed)
        low, high = min(runs[-1].low for runs in per_seed), max(runs[-1].high for runs in per_seed)
        lines.append(f"| {variant} | {len(per_seed)} | {tokens} | {num(final)} | [{num(low)}, {num(high)}] |")
    return "\n".join(lines)


def plot(points: dict[str, list[list[EvalPoint]]], target: float, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, per_seed in points.items():
        x, mean, low, high = band([[(p.tokens, p.accuracy) for p in runs] for runs in per_seed])
        (line,) = ax.plot(x, mean, marker="o", label=f"{variant} (mean of {len(per_seed)} seeds)")
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


def branching_note(branched: dict) -> str | None:
    """A warning when the STORPO runs branched from fewer than FEW_BRANCHES of their prompts, on average."""
    mean = mean_or_none([b for b in branched.values() if b is not None])
    if mean is None or mean >= FEW_BRANCHES:
        return None
    return (
        f"STORPO branched from {mean:.1%} of its prompts (mean over runs and rounds): the "
        "other initial completions had fewer than variant.min_steps step boundaries, so their prompts were sampled "
        "as plain groups. Both sides trained on GRPO groups; this comparison does not test branching."
    )


def results(points, seeds: list[int], walls: dict, branched: dict, target: float, target_note: str) -> str:
    """The tables after the settings: the target, per variant, per run; then the branching warning, if any."""
    rule = f"target pass@1: {target:.3f} ({target_note}); tokens to it: {TARGET_RULE}"
    parts = [rule, summary_table(points, target), runs_table(points, seeds, walls, branched, target)]
    note = branching_note(branched)
    return "\n\n".join(parts if note is None else [*parts, note])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="learn_arith", help="the recipe whose task both variants train on")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=50_000, help="completion tokens generated per run")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many rounds")
    parser.add_argument("--target", type=float, default=None, help=f"pass@1 for tokens-to-target ({DEFAULT_TARGET})")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/variants"))
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both variants")
    args = parser.parse_args(argv)
    shared = pinned(args.budget, args.eval_every)
    overrides = {v: variant_overrides(args.experiment, v, shared, args.overrides) for v in VARIANTS}
    try:  # a missing recipe or a bad override fails now, not hours later
        configs = {v: compose(o) for v, o in overrides.items()}
    except ValueError as e:
        parser.error(str(e))
    check_equal(configs, list(shared))
    settings = settings_table(configs, [*shared, "variant._target_", *STORPO_PINNED])
    header = f"experiment={args.experiment}, seeds {args.seeds}, extra overrides {args.overrides}\n\n{settings}"
    print(header, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [Job(f"{v}_seed{seed}", (*overrides[v], f"seed={seed}")) for seed in args.seeds for v in VARIANTS]
    run_jobs(args.out, jobs, parallel=not args.sequential, force=args.force)
    runs = {(v, s): read_run(args.out / f"{v}_seed{s}") for v in VARIANTS for s in args.seeds}
    points = {v: [eval_points(runs[v, s]) for s in args.seeds] for v in VARIANTS}
    branched = {key: branched_fraction(run) for key, run in runs.items()}
    walls = {key: wall_seconds(run.path) for key, run in runs.items()}
    target, note = (args.target, "--target") if args.target is not None else (default_target(points), DEFAULT_TARGET)
    text = results(points, args.seeds, walls, branched, target, note)
    print(text)
    (args.out / "variants.md").write_text(f"{header}\n\n{text}\n")
    plot(points, target, args.budget, args.out / "variants.png")
    print(f"wrote {args.out / 'variants.md'} and {args.out / 'variants.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
