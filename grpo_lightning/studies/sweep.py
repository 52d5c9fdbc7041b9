"""Hydra callback that writes a summary of a multirun sweep when it ends: a table of final metrics (CSV and
Markdown) and a picture of the main curves of every job (`summary.png`, grpo_lightning/studies/sweep_plot.py).

Each job writes `final_metrics.json` into its own output dir (`train.write_final_metrics`), so the summary works
the same for the in-process launcher and for process-per-job launchers (joblib, submitit): it only reads files.
The summary never fails a sweep: a picture that cannot be drawn costs one logged line, the jobs' results stay.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

DEFAULT_METRICS = (
    "train/reward_mean",
    "eval/accuracy",
    "eval/gsm8k_accuracy",
    "eval/format_rate",
    "train/kl",
    "rollout/completion_len_mean",
    "rollout/tokens_generated_per_prompt",
    "rollout/tokens_generated_total",
)
GAME_PREFIXES = ("eval/win_rate_vs_", "eval/illegal_move_rate", "game/win_rate", "game/illegal_move_rate")
"""Self-play's rates (docs/selfplay.md): columns of the summary when a job logged them."""


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job dir holding `final_metrics.json`: its overrides (as `key=value` text) and its metrics."""
    rows = []
    for metrics_file in sorted(sweep_dir.glob("*/final_metrics.json")):
        job_dir = metrics_file.parent
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.is_file() else []
        rows.append({"job": job_dir.name, "overrides": " ".join(overrides), **json.loads(metrics_file.read_text())})
    return rows


def write_summary(sweep_dir: Path, metrics: tuple[str, ...] = DEFAULT_METRICS) -> list[dict[str, Any]]:
    """Write `summary.csv` and `summary.md` in `sweep_dir`; returns the rows.

    Besides `metrics`, every game rate any job logged (self-play: `eval/win_rate_vs_<opponent>` and its interval,
    the illegal-move rates) and every reward term (`reward/<term>_mean`) gets a column, so a sweep over rewards
    (`-m reward=gsm8k,gsm8k_shaped`) shows each reward's terms; a job without one leaves it blank.
    """
    rows = collect_jobs(sweep_dir)
    games = dict.fromkeys(k for row in rows for k in row if k.startswith(GAME_PREFIXES) and k not in metrics)
    terms = dict.fromkeys(k for row in rows for k in row if k.startswith("reward/") and k not in metrics)
    columns = ["job", "overrides", *metrics, *sorted(games),
               *sorted(terms, key=lambda k: (k != "reward/total_mean", k))]  # fmt: skip
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class SweepSummary(Callback):
    """`hydra.callbacks.sweep_summary`: after the last job, summarise the sweep directory (table and picture)."""

    def __init__(self, metrics: list[str] | None = None) -> None:
        self.metrics = tuple(metrics) if metrics else DEFAULT_METRICS

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir, self.metrics)
        log.info("sweep summary of %d jobs: %s", len(rows), sweep_dir / "summary.md")
        print((sweep_dir / "summary.md").read_text())
        write_picture(sweep_dir)


def write_picture(sweep_dir: Path) -> None:
    """`summary.png` of the sweep's curves; any failure is logged in one line, never raised."""
    try:
        from grpo_lightning.studies.sweep_plot import plot_sweep_summary

        if plot_sweep_summary(sweep_dir) and (sweep_dir / "summary.png").is_file():
            print(f"sweep curves: {sweep_dir / 'summary.png'}")
    except Exception as err:  # noqa: BLE001 - the picture is a convenience; the sweep's results are already written
        log.warning("summary.png not written: %s: %s", type(err).__name__, err)
