"""Read the TensorBoard event files of runs and sweeps, and plot metrics per variant with mean and spread.

The code behind `notebooks/compare_runs.ipynb` and the learning benchmarks (benchmarks/learning.py,
benchmarks/variants.py; docs/learning.md), importable so tests run it. Needs the `analysis` extra (matplotlib)
only for plotting; reading uses tensorboard's EventAccumulator, already a dependency.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PLOTTED = (
    "train/reward_mean",
    "eval/accuracy",
    "eval/gsm8k_accuracy",
    "train/kl",
    "rollout/completion_len_mean",
    "probe/gns/B_simple",
    "probe/entropy/seq_mean",
)
TOKENS = "rollout/tokens_generated_total"
"""Every completion token sampled since the run began, logged with each round's metrics."""
EVAL_TAGS = {
    "accuracy": "eval/accuracy",  # greedy pass@1, answer extracted whatever its format (the last number)
    "low": "eval/accuracy_ci95_low",  # its 95% Wilson interval
    "high": "eval/accuracy_ci95_high",
    "strict": "eval/accuracy_strict",  # correct and in the answer format the prompt asks for
    "format_rate": "eval/format_rate",  # answers in that format
}
"""The evaluation metrics every dataset logs, by the `EvalPoint` field that holds them."""


@dataclass
class RunData:
    """One run: its directory, its Hydra overrides and its scalar series (tag -> [(step, value)])."""

    path: Path
    overrides: dict[str, str]
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    wall_times: dict[str, list[float]] = field(default_factory=dict)
    """Per tag, the wall-clock time (seconds since the epoch) at which each scalar of `scalars` was written."""

    def label(self, key: str) -> str:
        """The run's value of an override key (e.g. 'variant'), defaulting as the config does."""
        return self.overrides.get(key, "grpo" if key == "variant" else "default")


def read_run(run_dir: str | Path) -> RunData:
    """Scalars from `<run_dir>/tensorboard` (all event files), overrides from `<run_dir>/.hydra/overrides.yaml`."""
    run_dir = Path(run_dir)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}
    wall_times = {tag: [e.wall_time for e in acc.Scalars(tag)] for tag in tags}
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    pairs = [str(o).split("=", 1) for o in OmegaConf.load(overrides_file)] if overrides_file.is_file() else []
    overrides = {k.lstrip("+~"): v for k, v in (p for p in pairs if len(p) == 2)}
    return RunData(run_dir, overrides, scalars, wall_times)


def series(run: RunData, tag: str) -> list[float]:
    """The values of `tag` in step order (one per round for round metrics)."""
    return [value for _, value in sorted(run.scalars.get(tag, []), key=lambda sv: sv[0])]


def time_to_target(run: RunData, tag: str, target: float, window: int = 3) -> float | None:
    """Seconds from the run's first logged scalar until the mean of `tag` over the last `window` points first
    reaches `target`; None if it never does. A moving mean, because one round's value is a few prompts' worth."""
    points = sorted(zip(run.scalars.get(tag, []), run.wall_times.get(tag, []), strict=True), key=lambda p: p[0][0])
    start = min((t for times in run.wall_times.values() for t in times), default=None)
    values = [v for (_, v), _ in points]
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        if len(recent) == window and sum(recent) / window >= target:
            return points[i][1] - start
    return None


def read_sweep(sweep_dir: str | Path) -> list[RunData]:
    """Every run below a sweep (or outputs) directory, i.e. every folder holding a `tensorboard/` folder."""
    return [read_run(tb.parent) for tb in sorted(Path(sweep_dir).glob("**/tensorboard")) if tb.is_dir()]


def group_by(runs: list[RunData], key: str = "variant") -> dict[str, list[RunData]]:
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.label(key), []).append(run)
    return groups


def mean_and_spread(runs: list[RunData], tag: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step present in any run: mean, min and max over the runs that logged `tag` at that step."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run.scalars.get(tag, []):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (
        steps,
        [sum(by_step[s]) / len(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def plot_sweep(runs: list[RunData], tags: tuple[str, ...] = PLOTTED, key: str = "variant"):
    """One panel per tag that any run logged: a line per group (mean over seeds) and a band (min..max)."""
    import matplotlib.pyplot as plt

    present = [t for t in tags if any(t in r.scalars for r in runs)]
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * max(len(present), 1)), squeeze=False)
    groups = group_by(runs, key)
    for ax, tag in zip(axes[:, 0], present, strict=True):
        for name, members in sorted(groups.items()):
            steps, mean, low, high = mean_and_spread(members, tag)
            if steps:
                ax.plot(steps, mean, marker="o", label=f"{key}={name} (n={len(members)})")
                ax.fill_between(steps, low, high, alpha=0.2)
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of a run (NaN for a metric the run did not log) and the tokens generated before it."""

    step: int
    tokens: float
    """`rollout/tokens_generated_total` of the rounds trained before this evaluation (0 at the start)."""
    accuracy: float
    low: float
    high: float
    strict: float
    format_rate: float


def eval_points(run: RunData) -> list[EvalPoint]:
    """Every evaluation of the run in step order, each at the generated tokens of the rounds before it.

    The steps say which rounds came before: a round's metrics are logged at its last optimizer step (global step
    - 1 at its end), the evaluation after it at the global step, the start-of-run evaluation at step 0 before
    any round. So the evaluation at step s follows exactly the rounds logged at steps below s.
    """
    values = {name: dict(run.scalars.get(tag, [])) for name, tag in EVAL_TAGS.items()}  # a resumed step: last wins
    rounds = sorted(dict(run.scalars.get(TOKENS, [])).items())
    round_steps = [step for step, _ in rounds]
    points = []
    for step in sorted({s for by_step in values.values() for s in by_step}):
        before = bisect.bisect_left(round_steps, step)
        tokens = rounds[before - 1][1] if before else 0.0
        metrics = {name: by_step.get(step, math.nan) for name, by_step in values.items()}
        points.append(EvalPoint(step, tokens, **metrics))
    return points


def tokens_to_target(points: list[EvalPoint], target: float) -> float | None:
    """Generated tokens at which pass@1 first reaches `target`, linearly interpolated between the last evaluation
    below it and the first at or above it (0 if the first evaluation is already there); None if none reaches it.

    Interpolated, because evaluations are several rounds apart: the first evaluation past the target is late by
    up to that many rounds' tokens, more for the variant whose rounds generate more."""
    previous = None
    for point in points:
        if point.accuracy >= target:
            if previous is None:
                return point.tokens
            share = (target - previous.accuracy) / (point.accuracy - previous.accuracy)
            return previous.tokens + share * (point.tokens - previous.tokens)
        if math.isfinite(point.accuracy):
            previous = point
    return None


def band(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean, min and max over curves of (x, y) points, each linearly interpolated onto the union of their x
    values up to the shortest curve's end (beyond it a band would hide that some runs stopped)."""
    curves = [sorted((x, y) for x, y in c if math.isfinite(y)) for c in curves]
    curves = [c for c in curves if c]
    if not curves:
        return [], [], [], []
    end = min(c[-1][0] for c in curves)
    grid = sorted({x for c in curves for x, _ in c if x <= end})
    at = [[interpolate(c, x) for c in curves] for x in grid]
    return grid, [sum(v) / len(v) for v in at], [min(v) for v in at], [max(v) for v in at]


def interpolate(curve: list[tuple[float, float]], x: float) -> float:
    """y at x on the piecewise-linear curve through sorted (x, y) points (held flat outside them)."""
    xs = [p[0] for p in curve]
    i = bisect.bisect_left(xs, x)
    if i < len(curve) and xs[i] == x:
        return curve[i][1]
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
