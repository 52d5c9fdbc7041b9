"""Does training make the model answer more problems correctly? A recipe against an lr=0 control, over seeds.

Runs `python -m grpo_lightning experiment=<recipe> seed=<s>` for every seed twice: trained, and an identical
control with `optim.optimizer.lr=0` (same first round, same evaluation, no update). Both evaluate greedy answers
on the recipe's fixed held-out problems. Reads every run's evaluations back (TensorBoard) and writes into the
output folder `learning.md` (printed too) and `learning.png`:

- per run: held-out pass@1 (`eval/accuracy`, the answer extracted whatever its format) with its 95% Wilson
  interval, the strict accuracy (correct and in the asked format) and the format rate, at the start and the end;
  generated tokens and wall time;
- per seed, trained against its own control at the end: the gains, and whether the trained run is ahead by
  more than its interval (the test is stated in the table);
- the plot: pass@1 and format rate against generated tokens, each arm's mean over seeds with a min..max band.

    python benchmarks/learning.py                              # experiment=learn_arith, seeds 0 1 2
    python benchmarks/learning.py --control-from-start         # no control runs (see below)
    python benchmarks/learning.py --experiment learn_cpu --arms trained control no_ds --seeds 0

Runs that finished before (a `final_metrics.json` in their folder) are read, not rerun (`--force` reruns).
`--control-from-start`: an lr=0 run never changes its parameters, so its greedy evaluation is the same at every
round; its pass@1 is then the trained run's own start-of-run evaluation (same model, decode and problems), and no
control is run. Arms: `trained`, `control` (lr=0), `no_ds` (trained without dynamic sampling), `overlap` (trained
with the next round sampled while this one trains, `rollout.max_staleness=1`: one optimizer step stale). With
`trained` and `overlap` both run, a table compares them seed by seed (the same seed samples the same first round and
evaluates the same problems):

    .venv-vllm/bin/python benchmarks/learning.py --control-from-start --arms trained overlap --sequential \
        generator=vllm_server generator.dtype=float32 generator.max_model_len=1024
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpo_lightning.studies.analysis import EvalPoint, band, eval_points, read_run, time_to_target
from grpo_lightning.studies.jobs import Job, compose, run_jobs, wall_seconds

ARMS = {
    "trained": (),
    "control": ("optim.optimizer.lr=0",),
    "no_ds": ("data.dynamic_sampling.enabled=false",),
    "overlap": ("rollout.max_staleness=1",),
}
YES_NO = {True: "yes", False: "no", None: "n/a"}
FROM_START = "control (trained run's start)"
"""The control arm's label when its pass@1 is the trained run's start-of-run evaluation."""
AHEAD_TEST = (
    "ahead = the trained run's 95% Wilson interval on its final pass@1 lies wholly above its own control's final "
    "pass@1 (same seed, same problems, same greedy decode). The control's pass@1 is a fixed number on these "
    "problems (greedy decoding of the unchanged start model), so this is a one-sided test at the 2.5% level of "
    "whether the trained model's pass@1 on problems like these exceeds it. It does not use the pairing of the "
    "two runs' per-problem outcomes (McNemar's test would; the overlap table pairs its two arms that way)"
)


@dataclass(frozen=True)
class Arm:
    """One run's evaluations as the table reads them."""

    start: EvalPoint
    end: EvalPoint
    wall_s: float


def arm_of(run_dir: Path) -> Arm:
    points = eval_points(read_run(run_dir))
    if not points:
        raise SystemExit(f"{run_dir}: no evaluation logged (eval.enabled=false?)")
    return Arm(points[0], points[-1], wall_seconds(run_dir))


def control_from_start(trained: Arm) -> Arm:
    """The lr=0 control's evaluation taken from the trained run's start-of-run evaluation."""
    if trained.start.tokens != 0:
        raise SystemExit("--control-from-start needs an evaluation at the start of the run (eval.at_start=true)")
    return Arm(trained.start, trained.start, math.nan)


def num(x: float, digits: int = 3) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"


def signed(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.3f}"


def with_interval(p: EvalPoint) -> str:
    return f"{num(p.accuracy)} [{num(p.low)}, {num(p.high)}]"


def runs_table(arms: dict[str, dict[int, Arm]]) -> str:
    lines = [
        "| arm | seed | pass@1 start [95% CI] | strict | format | pass@1 end [95% CI] | strict | format "
        "| tokens generated | wall min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_seed in arms.items():
        for seed, a in sorted(by_seed.items()):
            s, e = a.start, a.end
            lines.append(
                f"| {name} | {seed} | {with_interval(s)} | {num(s.strict)} | {num(s.format_rate)} "
                f"| {with_interval(e)} | {num(e.strict)} | {num(e.format_rate)} | {e.tokens:.0f} "
                f"| {num(a.wall_s / 60, 1)} |"
            )
    return "\n".join(lines)


def ahead(trained: EvalPoint, control: EvalPoint) -> bool | None:
    """The stated test (AHEAD_TEST): the trained run's interval low above the control's pass@1 (None: not
    logged)."""
    if not (math.isfinite(trained.low) and math.isfinite(control.accuracy)):
        return None
    return trained.low > control.accuracy


def gap_table(trained: dict[int, Arm], control: dict[int, Arm], control_label: str) -> str:
    """Trained against its own control at the end, per seed and mean, and whether every seed is ahead."""
    lines = [
        f"| seed | trained pass@1 end [95% CI] | {control_label} pass@1 | gain pass@1 | gain strict | gain format "
        "| ahead |",
        "|---|---|---|---|---|---|---|",
    ]
    gains, verdicts = [], []
    for seed in sorted(trained):
        t, c = trained[seed].end, control[seed].end
        gain = (t.accuracy - c.accuracy, t.strict - c.strict, t.format_rate - c.format_rate)
        gains.append(gain)
        verdicts.append(ahead(t, c))
        lines.append(
            f"| {seed} | {with_interval(t)} | {num(c.accuracy)} | {signed(gain[0])} | {signed(gain[1])} "
            f"| {signed(gain[2])} | {YES_NO[verdicts[-1]]} |"
        )
    mean = [sum(g[i] for g in gains) / len(gains) for i in range(3)]
    lines.append(f"| mean | | | {signed(mean[0])} | {signed(mean[1])} | {signed(mean[2])} | |")
    every = None if None in verdicts else all(verdicts)
    lines += ["", f"every seed ahead of its control: {YES_NO[every]} ({verdicts.count(True)} of {len(verdicts)})"]
    lines += ["", f"Test: {AHEAD_TEST}."]
    return "\n".join(lines)


def final_verdicts(run_dir: Path) -> list[bool]:
    """Whether each held-out problem was answered correctly at the run's last evaluation, in the subset's order
    (`eval.replies_dir`, training/evaluation.py)."""
    files = sorted((run_dir / "eval_replies").glob("step_*.jsonl"), key=lambda f: int(f.stem.removeprefix("step_")))
    if not files:
        raise SystemExit(f"{run_dir}: no eval_replies/step_<n>.jsonl (eval.replies_dir=null?)")
    return [json.loads(line)["correct"] for line in files[-1].read_text().splitlines()]


def paired_difference(a: list[bool], b: list[bool], z: float = 1.959964) -> tuple[float, float, float]:
    """Mean of a - b over paired outcomes (the same problems) and its 95% interval, from the per-problem
    differences' spread (normal approximation: several hundred pairs). Problems both runs solve, or both miss,
    add nothing to the spread: pairing is what makes the interval narrower than two runs' separate intervals."""
    if len(a) != len(b) or not a:
        raise SystemExit(f"paired outcomes of unequal length: {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
    half = z * math.sqrt(var / len(d))
    return mean, mean - half, mean + half


def overlap_table(sequential: dict[int, Path], overlapped: dict[int, Path]) -> str:
    """Overlapped rounds (one step stale) against sequential ones: the final pass@1's paired difference, seed by
    seed (each seed's two runs answer the same problems) and over every seed's pairs at once."""
    lines = [
        "| seed | problems | sequential pass@1 end | overlapped pass@1 end | difference [95% CI, paired] |",
        "|---|---|---|---|---|",
    ]
    every_s, every_o = [], []
    for seed in sorted(sequential):
        s, o = final_verdicts(sequential[seed]), final_verdicts(overlapped[seed])
        every_s += s
        every_o += o
        mean, low, high = paired_difference(o, s)
        lines.append(
            f"| {seed} | {len(s)} | {num(sum(s) / len(s))} | {num(sum(o) / len(o))} "
            f"| {signed(mean)} [{signed(low)}, {signed(high)}] |"
        )
    mean, low, high = paired_difference(every_o, every_s)
    lines.append(
        f"| all | {len(every_s)} | {num(sum(every_s) / len(every_s))} | {num(sum(every_o) / len(every_o))} "
        f"| **{signed(mean)}** [{signed(low)}, {signed(high)}] |"
    )
    lines += ["", f"overlapped within 0.05 of sequential (the interval's low end above -0.05): {YES_NO[low > -0.05]}"]
    return "\n".join(lines)


def format_time_to_target(run_dirs: dict[str, dict[int, Path]], target: float) -> str:
    """Seconds until the training format rate (mean of 3 rounds) first reaches `target` (dynamic sampling's
    effect, docs/learning.md)."""
    lines = [f"time until rollout/format_rate (mean of 3 rounds) >= {target}:", ""]
    lines += ["| arm | seed | seconds |", "|---|---|---|"]
    for arm, by_seed in run_dirs.items():
        for seed, run_dir in sorted(by_seed.items()):
            t = time_to_target(read_run(run_dir), "rollout/format_rate", target)
            lines.append(f"| {arm} | {seed} | {'not reached' if t is None else f'{t:.0f}'} |")
    return "\n".join(lines)


def curves(run_dirs: dict[str, dict[int, Path]], from_start: bool) -> dict[str, list[list[EvalPoint]]]:
    """Each arm's evaluations per seed; the control from the start: the trained start held over the run."""
    out = {arm: [eval_points(read_run(d)) for _, d in sorted(by_seed.items())] for arm, by_seed in run_dirs.items()}
    if from_start:
        out[FROM_START] = [[p[0], EvalPoint(p[-1].step, p[-1].tokens, *fields(p[0]))] for p in out["trained"]]
    return out


def fields(p: EvalPoint) -> tuple[float, ...]:
    return p.accuracy, p.low, p.high, p.strict, p.format_rate


def plot(arm_curves: dict[str, list[list[EvalPoint]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (field, title) in zip(axes, [("accuracy", "held-out pass@1"), ("format_rate", "format rate")], strict=True):
        for arm, per_seed in arm_curves.items():
            x, mean, low, high = band([[(p.tokens, getattr(p, field)) for p in points] for points in per_seed])
            dashed = arm.startswith("control")
            label = f"{arm} (lr=0)" if arm == "control" else arm
            (line,) = ax.plot(x, mean, "--" if dashed else "-", marker="o", label=f"{label}, n={len(per_seed)}")
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
        ax.set_title(f"{title}: mean over seeds, band min..max")
        ax.set_xlabel("completion tokens generated")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(experiment: str, seeds: list[int], run_dirs: dict[str, dict[int, Path]], from_start: bool) -> str:
    arms = {arm: {s: arm_of(d) for s, d in by_seed.items()} for arm, by_seed in run_dirs.items()}
    parts = [f"experiment={experiment}, seeds {seeds}", runs_table(arms)]
    if from_start:
        control = {s: control_from_start(a) for s, a in arms["trained"].items()}
        parts.append(
            "control: not run; an lr=0 run never changes its parameters, so its pass@1 is the trained run's own "
            "start-of-run evaluation (same model, same greedy decode, same problems)"
        )
        parts.append(gap_table(arms["trained"], control, FROM_START))
    elif "trained" in arms and "control" in arms:
        parts.append(gap_table(arms["trained"], arms["control"], "control (lr=0)"))
    if "trained" in arms and "overlap" in arms:
        parts.append(overlap_table(run_dirs["trained"], run_dirs["overlap"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="learn_arith", help="the recipe (default: learn_arith)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=None, choices=sorted(ARMS), help="default: trained control")
    parser.add_argument("--control-from-start", action="store_true", help="control = the trained run's start")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learning"))
    parser.add_argument("--format-target", type=float, help="also: time until the training format rate reaches it")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    arms = args.arms or (["trained"] if args.control_from_start else ["trained", "control"])
    if args.control_from_start and ("control" in arms or "trained" not in arms):
        parser.error("--control-from-start takes the control from the trained arm: run trained, not control")
    try:  # a missing recipe or a bad override fails now, not hours later
        compose([f"experiment={args.experiment}", *args.overrides])
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [
        Job(f"{arm}_seed{seed}", (f"experiment={args.experiment}", f"seed={seed}", *ARMS[arm], *args.overrides))
        for seed in args.seeds
        for arm in arms
    ]
    run_jobs(args.out, jobs, parallel=not args.sequential, force=args.force)
    run_dirs = {arm: {seed: args.out / f"{arm}_seed{seed}" for seed in args.seeds} for arm in arms}
    text = report(args.experiment, args.seeds, run_dirs, args.control_from_start)
    if args.format_target is not None:
        text += "\n\n" + format_time_to_target(run_dirs, args.format_target)
    print(text)
    (args.out / "learning.md").write_text(text + "\n")
    plot(curves(run_dirs, args.control_from_start), args.out / "learning.png")
    print(f"wrote {args.out / 'learning.md'} and {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
