"""Does self-play make the model a better player? experiment=selfplay_tictactoe against its control, over seeds.

Runs `python -m grpo_lightning experiment=<recipe> seed=<s>` per seed, reads every run's evaluations back
(TensorBoard) and writes `selfplay.md` (printed too) and `selfplay.png` into the output folder:

- per run, at the start and the end: the win rate against the random-move player and against the base model,
  each with its 95% Wilson interval, and the illegal-move rate with its interval;
- per seed, the trained run's end against its control: whether the win rate against random rose and the
  illegal-move rate fell beyond the intervals (the test is stated in the table);
- the plot: both rates against the round, each seed's trained run and its control.

The control (`--control lr0`, the default) is the same recipe with `optim.optimizer.lr=0`. `--control start`
runs none: an lr=0 run never changes its weights, and the game evaluation samples under a fixed seed
(`eval.seed`), so its every evaluation plays exactly the games of the trained run's start-of-run evaluation
(tests/unit/test_selfplay.py checks that two evaluations of unchanged weights are identical, and the table says
whether a finished lr=0 run's evaluations all equal its trained run's start). A seed whose lr=0 run has finished
in the output folder is compared with it either way.

    python benchmarks/selfplay.py                         # seeds 0 1 2, trained + lr=0 controls
    python benchmarks/selfplay.py --seeds 1 2 --control start   # half the compute: control = each run's start
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from grpo_lightning.app.analysis import read_run
from grpo_lightning.app.jobs import Job, compose, finished, run_jobs, wall_seconds

WIN = "eval/win_rate_vs_random"
WIN_BASE = "eval/win_rate_vs_base"
ILLEGAL = "eval/illegal_move_rate"
BEYOND_TEST = (
    "beyond = the trained run's 95% Wilson interval at the end lies wholly on the better side of its control's "
    "rate (win rate: above, illegal-move rate: below). The control's evaluation plays the same seeded games with "
    "the unchanged start model"
)


@dataclass(frozen=True)
class Point:
    """One evaluation: a rate with its interval, by metric."""

    step: int
    rates: dict[str, tuple[float, float, float]]


def evaluations(run_dir: Path) -> list[Point]:
    """Every evaluation of a run, in step order (rate, low, high of each of WIN, WIN_BASE, ILLEGAL)."""
    run = read_run(run_dir)
    steps = sorted({s for s, _ in run.scalars.get(WIN, [])})
    points = []
    for step in steps:
        rates = {}
        for tag in (WIN, WIN_BASE, ILLEGAL):
            values = {
                suffix: dict(run.scalars.get(tag + suffix, [])).get(step) for suffix in ("", "_ci95_low", "_ci95_high")
            }
            if values[""] is not None:
                rates[tag] = (values[""], values["_ci95_low"], values["_ci95_high"])
        points.append(Point(step, rates))
    return points


def finished_seeds(out: Path) -> set[int]:
    """Seeds whose trained run has finished in `out` (read into the table whatever `--seeds` says)."""
    return {int(d.name.removeprefix("trained_seed")) for d in out.glob("trained_seed*") if finished(d)}


def fmt(rate: tuple[float, float, float] | None) -> str:
    if rate is None:
        return "n/a"
    value, low, high = rate
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def beyond(trained: tuple[float, float, float], control: tuple[float, float, float], higher_is_better: bool) -> bool:
    _, low, high = trained
    return low > control[0] if higher_is_better else high < control[0]


def report(runs: dict[int, tuple[list[Point], list[Point], float]], labels: dict[int, str]) -> str:
    """`runs`: seed -> (trained evaluations, control evaluations, trained wall seconds); `labels`: each seed's
    control, `control (lr=0)` or `control (start)`."""
    lines = [
        "| seed | arm | win vs random, start -> end | win vs base, end | illegal-move rate, start -> end | wall |",
        "|---|---|---|---|---|---|",
    ]
    gaps = [
        "| seed | control | win vs random: trained end - control | beyond | illegal-move rate: trained end - "
        "control | beyond |",
        "|---|---|---|---|---|---|",
    ]
    for seed, (trained, control, wall) in sorted(runs.items()):
        for arm, points, seconds in (("trained", trained, wall), (labels[seed], control, None)):
            start, end = points[0].rates, points[-1].rates
            lines.append(
                f"| {seed} | {arm} | {fmt(start.get(WIN))} -> {fmt(end.get(WIN))} | {fmt(end.get(WIN_BASE))} | "
                f"{fmt(start.get(ILLEGAL))} -> {fmt(end.get(ILLEGAL))} | "
                f"{'' if seconds is None else f'{seconds / 60:.1f} min'} |"
            )
        t, c = trained[-1].rates, control[-1].rates
        win_beyond = "yes" if beyond(t[WIN], c[WIN], True) else "no"
        illegal_beyond = "yes" if beyond(t[ILLEGAL], c[ILLEGAL], False) else "no"
        control_kind = labels[seed].removeprefix("control (").removesuffix(")")
        gaps.append(
            f"| {seed} | {control_kind} | {t[WIN][0] - c[WIN][0]:+.3f} | {win_beyond} | "
            f"{t[ILLEGAL][0] - c[ILLEGAL][0]:+.3f} | {illegal_beyond} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(gaps) + "\n\n" + BEYOND_TEST


def plot(runs: dict[int, tuple[list[Point], list[Point], float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, tag, title in ((axes[0], WIN, "win rate vs random"), (axes[1], ILLEGAL, "illegal-move rate")):
        for seed, (trained, control, _) in sorted(runs.items()):
            for points, style, arm in ((trained, "-o", "trained"), (control, ":", "control")):
                xs = [p.step for p in points if tag in p.rates]
                ys = [p.rates[tag][0] for p in points if tag in p.rates]
                if arm == "control" and len(xs) == 1:  # the start evaluation, held level
                    xs, ys = [xs[0], trained[-1].step], ys * 2
                ax.plot(xs, ys, style, label=f"{arm} seed {seed}")
        ax.set_title(title)
        ax.set_xlabel("optimizer step (one per round)")
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="selfplay_tictactoe")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--control", choices=("lr0", "start"), default="lr0")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/selfplay"))
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    try:  # a missing recipe or a bad override fails now, not an hour later
        compose([f"experiment={args.experiment}", *args.overrides])
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    arms = {"trained": ()} | ({"control": ("optim.optimizer.lr=0",)} if args.control == "lr0" else {})
    jobs = [
        Job(f"{arm}_seed{seed}", (f"experiment={args.experiment}", f"seed={seed}", *extra, *args.overrides))
        for seed in args.seeds
        for arm, extra in arms.items()
    ]
    run_jobs(args.out, jobs, parallel=not args.sequential, force=args.force)
    runs, labels, notes = {}, {}, []
    for seed in sorted({*args.seeds, *finished_seeds(args.out)}):
        trained = evaluations(args.out / f"trained_seed{seed}")
        control_dir = args.out / f"control_seed{seed}"
        if finished(control_dir):
            control, labels[seed] = evaluations(control_dir), "control (lr=0)"
            same = all(p.rates == trained[0].rates for p in control)
            notes.append(
                f"seed {seed}: every evaluation of the lr=0 run {'equals' if same else 'DIFFERS from'} the trained "
                "run's start-of-run evaluation"
            )
        else:
            control, labels[seed] = trained[:1], "control (start)"
        runs[seed] = (trained, control, wall_seconds(args.out / f"trained_seed{seed}"))
    text = f"experiment={args.experiment}, seeds {sorted(runs)}\n\n" + report(runs, labels)
    if notes:
        text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    print(text)
    (args.out / "selfplay.md").write_text(text + "\n")
    plot(runs, args.out / "selfplay.png")
    print(f"wrote {args.out / 'selfplay.md'} and {args.out / 'selfplay.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
