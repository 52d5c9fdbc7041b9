"""`summary.png` of a sweep: the main curves of every job against the optimizer step, seeds pooled into a band.

Written by the sweep summary (`grpo_lightning.studies.sweep.SweepSummary`) beside `summary.md`, so a sweep's end shows
not only where each setting finished but how it got there: the final numbers of a few-prompt round are noisy, the
curve and its spread over seeds are not. Jobs whose overrides differ only by `seed` form one group, drawn as the
mean over its seeds with a min..max band (the spread the notebook `notebooks/compare_runs.ipynb` draws too); a
group is labelled by the overrides that set it apart from the other groups, never by those every job shares.

Each job's series come from its TensorBoard event files (tensorboard's `EventAccumulator`, any folder below the
job), else from a Lightning `CSVLogger`'s `metrics.csv`, else from `final_metrics.json` (the end value only, drawn
as one point at the last step any job reached). The x axis is the logged step, which is the optimizer step: round
metrics and evaluations are logged at `trainer.global_step` (docs/configuration.md, "Sweeps").

Needs matplotlib (the `analysis` extra) to draw; without it the series are still computed and one line says why
no picture was written. It draws through the Agg canvas, never pyplot, so it touches no process-wide state.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from grpo_lightning.studies.analysis import RunData, mean_and_spread

log = logging.getLogger(__name__)

PLOTTED = ("train/reward_mean", "eval/gsm8k_accuracy", "eval/accuracy")
"""The panels, in order; a tag no job logged gets none (`eval/accuracy` only where an evaluation logs it)."""
SEED_KEYS = ("seed",)
"""Override keys whose jobs are pooled into one group (their runs differ only by chance)."""


@dataclass
class Curve:
    """One line of the picture: a group's mean of `tag` per step and its min..max band over the group's jobs."""

    tag: str
    label: str
    """The overrides that set the group apart, `key=value` joined by spaces ("" when the sweep has one group)."""
    jobs: list[str]
    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]


def read_overrides(job_dir: Path) -> list[str]:
    """The job's Hydra overrides as written (`.hydra/overrides.yaml`), `[]` when there is none."""
    path = job_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []


def read_job(job_dir: str | Path) -> RunData:
    """A job's scalar series: event files, else `metrics.csv`, else `final_metrics.json` (steps are -1 there)."""
    job_dir = Path(job_dir)
    overrides = dict(o.lstrip("+").split("=", 1) for o in read_overrides(job_dir) if "=" in o)
    run = RunData(job_dir, overrides)
    for reader in (_event_scalars, _csv_scalars, _final_scalars):
        run.scalars = reader(job_dir)
        if run.scalars:
            break
    return run


def _event_scalars(job_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for folder in sorted({p.parent for p in job_dir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


def _csv_scalars(job_dir: Path) -> dict[str, list[tuple[int, float]]]:
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(job_dir.rglob("metrics.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if not row.get("step"):
                    continue
                step = int(float(row["step"]))
                for tag, value in row.items():
                    if tag not in ("step", "epoch") and value not in ("", None):
                        scalars.setdefault(tag, {})[step] = float(value)
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


def _final_scalars(job_dir: Path) -> dict[str, list[tuple[int, float]]]:
    path = job_dir / "final_metrics.json"
    if not path.is_file():
        return {}
    return {tag: [(-1, float(v))] for tag, v in json.loads(path.read_text()).items() if isinstance(v, int | float)}


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job folders (`<n>_<overrides>`, with a `.hydra` folder or final metrics), in job order."""
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir() or (p / "final_metrics.json").is_file()]
    return sorted(jobs, key=_job_number)


def _job_number(job_dir: Path) -> tuple[float, str]:
    number = job_dir.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else math.inf, job_dir.name)


def group_by_settings(runs: list[RunData]) -> dict[str, list[RunData]]:
    """Jobs that differ only by a seed key, by the label of the overrides that set their group apart.

    A key is in the labels when the groups do not all give it the same value (a group that does not override it
    counts as one more value, and its label leaves the key out). Labels keep the order keys first appear in.
    """
    groups: dict[tuple, list[RunData]] = {}
    for run in runs:
        settings = tuple((k, v) for k, v in run.overrides.items() if k not in SEED_KEYS)
        groups.setdefault(tuple(sorted(settings)), []).append(run)
    keys = list(dict.fromkeys(k for run in runs for k in run.overrides if k not in SEED_KEYS))
    differing = [k for k in keys if len({dict(settings).get(k) for settings in groups}) > 1]
    labelled: dict[str, list[RunData]] = {}
    for settings, members in groups.items():
        values = dict(settings)
        label = " ".join(f"{k}={values[k]}" for k in differing if k in values)
        labelled[label] = members
    return labelled


def sweep_curves(runs: list[RunData], tags: tuple[str, ...] = PLOTTED) -> list[Curve]:
    """The lines of the picture: for each tag any job logged, one per group (mean and min..max over its jobs)."""
    curves = []
    end = max((s for r in runs for points in r.scalars.values() for s, _ in points), default=0)
    for tag in tags:
        for label, members in group_by_settings(runs).items():
            placed = [RunData(r.path, r.overrides, _place_final(r.scalars, tag, end)) for r in members]
            steps, mean, low, high = mean_and_spread(placed, tag)
            if steps:
                curves.append(Curve(tag, label, [r.path.name for r in members], steps, mean, low, high))
    return curves


def _place_final(scalars: dict[str, list[tuple[int, float]]], tag: str, end: int) -> dict[str, list]:
    """`tag`'s series, a final-value-only point (step -1) moved to `end`, the last step any job logged."""
    return {tag: [(end if step < 0 else step, value) for step, value in scalars.get(tag, [])]}


def plot_sweep_summary(sweep_dir: str | Path, tags: tuple[str, ...] = PLOTTED) -> list[Curve]:
    """Write `summary.png` in `sweep_dir` (when matplotlib is installed); returns the curves it draws."""
    sweep_dir = Path(sweep_dir)
    runs = [read_job(job) for job in job_dirs(sweep_dir)]
    curves = sweep_curves(runs, tags)
    if not curves:
        log.info("summary.png not written: no job logged any of %s", ", ".join(tags))
        return curves
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("summary.png not written: matplotlib is not installed (pip install 'grpo_lightning[analysis]')")
        return curves
    panels = list(dict.fromkeys(c.tag for c in curves))
    fig = Figure(figsize=(5.0 * len(panels), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, tag in zip(axes, panels, strict=True):
        for curve in (c for c in curves if c.tag == tag):
            name = curve.label or "all jobs"
            (line,) = ax.plot(curve.steps, curve.mean, marker="o", markersize=3, label=f"{name} (n={len(curve.jobs)})")
            if len(curve.jobs) > 1:
                ax.fill_between(curve.steps, curve.low, curve.high, color=line.get_color(), alpha=0.2)
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{sweep_dir.name}: mean over seeds, band min..max", fontsize="medium")
    fig.tight_layout()
    fig.savefig(sweep_dir / "summary.png", dpi=110)
    return curves
