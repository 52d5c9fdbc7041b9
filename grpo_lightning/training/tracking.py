"""The one place where rich records reach the experiment trackers: hyperparameters, sample tables, histograms and
the run's closing summary, fanned out to every logger of the run (`logger=[tensorboard,wandb]`, docs/tracking.md).

Scalars go through Lightning (`self.log`, `logger.log_metrics`), which every logger understands. Tables,
histograms and text have no common Lightning interface, so each logger class is mapped to a `Writer` that knows its
tracker's types (`WRITERS`): TensorBoard's text and histogram summaries, a W&B `Table` and `Histogram`, an MLflow
JSON table artifact, a CSV file beside `metrics.csv`. A kind the tracker has no type for is skipped, for the reason
its writer states. A logger class that is not in the mapping gets scalars and hyperparameters only (one warning).

The trackers' own packages (wandb, mlflow) are imported inside their writers, when a run that uses them logs:
a run with `logger=tensorboard` never imports them.

The call sites are rank 0's (`trainer.is_global_zero`); Lightning's loggers do nothing on other ranks anyway.
"""

from __future__ import annotations

import csv
import logging
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from grpo_lightning.algorithm.round_metrics import markdown_cell

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Column:
    """A table column: its name, and how a cell reads in a Markdown table (TensorBoard's text)."""

    name: str
    spec: str = ""
    """The format spec of the cell in Markdown ("+.2f"); trackers with a table type get the value itself."""
    max_chars: int | None = None
    """Markdown cells of text are cut to this many characters (None: whole); a table type gets the whole text."""

    def markdown(self, value: Any) -> str:
        text = format(value, self.spec)
        return markdown_cell(text, self.max_chars or sys.maxsize) if isinstance(value, str) else text


@dataclass(frozen=True)
class Table:
    """Rows of typed values (int, float, str) under named columns: a sample table."""

    columns: tuple[Column, ...]
    rows: tuple[tuple[Any, ...], ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.names) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(c.markdown(v) for c, v in zip(self.columns, row, strict=True)) + " |"
                  for row in self.rows]  # fmt: skip
        return "\n".join(lines)


class Writer:
    """What one tracker does with each kind of record. The base writes nothing: a tracker without the type."""

    package: str | None = None
    """The module the tracker needs (`pip install grpo_lightning[<package>]`); None: none beyond the defaults."""
    no_histograms: str = ""
    """Why histograms are skipped (empty: they are written)."""

    def table(self, logger: Logger, tag: str, table: Table, step: int) -> None:
        """A sample table at `step`."""

    def histogram(self, logger: Logger, tag: str, values: list[float], step: int) -> None:
        """The distribution of `values` at `step`."""

    def text(self, logger: Logger, tag: str, text: str, step: int) -> None:
        """A block of plain text (the run summary) at `step`."""

    def close(self, logger: Logger) -> None:
        """After Lightning's `finalize`: end what the tracker keeps open for the process."""

    def describe(self, logger: Logger) -> str:
        """Where the run's records are and how to open them (printed at the end of a run)."""
        return ""


class TensorBoardWriter(Writer):
    """Markdown text (TensorBoard's TEXT tab renders tables) and histograms, on the logger's SummaryWriter."""

    def table(self, logger, tag, table, step):
        logger.experiment.add_text(tag, table.markdown(), step)

    def histogram(self, logger, tag, values, step):
        logger.experiment.add_histogram(tag, torch.tensor(values), step)

    def text(self, logger, tag, text, step):
        logger.experiment.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)  # preformatted

    def describe(self, logger):
        return f"TensorBoard logs: tensorboard --logdir {Path(logger.save_dir).resolve()}"


class WandbWriter(Writer):
    """`wandb.Table` and `wandb.Histogram`, logged through the logger so they share its `trainer/global_step` axis
    (a W&B step of one's own would be behind Lightning's and dropped)."""

    package = "wandb"

    def table(self, logger, tag, table, step):
        logger.log_table(tag, columns=table.names, data=[list(row) for row in table.rows], step=step)

    def histogram(self, logger, tag, values, step):
        import wandb

        logger.log_metrics({tag: wandb.Histogram(values)}, step=step)

    def text(self, logger, tag, text, step):
        logger.log_text(tag, columns=[tag], data=[[text]], step=step)  # W&B's text type is a table cell

    def close(self, logger):
        logger.experiment.finish()  # a later run in this process would otherwise continue this one

    def describe(self, logger):
        run = logger.experiment
        folder = Path(run.dir).parent
        return (
            f"W&B run (offline): {folder}; upload it with: wandb sync {folder}"
            if run.offline
            else f"W&B run: {run.url}"
        )


class MLflowWriter(Writer):
    """Tables as JSON artifacts in the layout `MlflowClient.log_table` writes ({"columns", "data"}), without its
    pandas dependency; text as a .txt artifact."""

    package = "mlflow"
    no_histograms = "MLflow records scalars, parameters and artifacts; it has no histogram type"

    def table(self, logger, tag, table, step):
        data = {"columns": table.names, "data": [list(row) for row in table.rows]}
        logger.experiment.log_dict(logger.run_id, data, f"{tag}/step_{step:06d}.json")

    def text(self, logger, tag, text, step):
        logger.experiment.log_text(logger.run_id, text, f"{tag}.txt")

    def describe(self, logger):
        return f"MLflow run {logger.run_id}: mlflow ui --backend-store-uri {logger.experiment.tracking_uri}"


class CSVWriter(Writer):
    """Files beside `metrics.csv`: `<tag>.csv` (one row per table row, after a `step` column) and `<tag>.txt`."""

    no_histograms = "CSV files hold one number per metric and step; a histogram is not one"

    def __init__(self) -> None:
        self.started: weakref.WeakKeyDictionary[Logger, set[str]] = weakref.WeakKeyDictionary()
        """The tables each logger has written in this process. A table file that a logger meets for the first
        time may come from an earlier attempt of a resumed run: its rows from `step` on are dropped (logged
        again now), as `ResumingExperimentWriter` does for metrics.csv."""

    def table(self, logger, tag, table, step):
        path = Path(logger.experiment.log_dir) / f"{tag}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        tags = self.started.setdefault(logger, set())
        if tag not in tags:
            tags.add(tag)
            drop_steps_from(path, step)
        new = not path.exists()
        with path.open("a", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            if new:
                out.writerow(["step", *table.names])
            out.writerows([step, *row] for row in table.rows)

    def text(self, logger, tag, text, step):
        path = Path(logger.experiment.log_dir) / f"{tag}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")

    def describe(self, logger):
        return f"CSV logs: {Path(logger.log_dir).resolve()}"


def drop_steps_from(path: Path, first_step: int) -> None:
    """Rewrite the CSV file at `path` without its rows at step `first_step` or later (a `step` column)."""
    if not path.is_file():
        return
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or [], list(reader)
    kept = [r for r in rows if r.get("step") in (None, "") or int(float(r["step"])) < first_step]
    if len(kept) == len(rows):
        return
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(kept)


class ResumingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, keeping what an earlier attempt of the run wrote.

    Lightning's writer deletes `metrics.csv` when it finds its folder non-empty, so a run resumed from a
    checkpoint (the same output directory) would lose every row logged before the interruption. This one keeps
    the file; at its first save it drops the rows at or after the first step it logs (the resumed run logs
    those again, from the checkpoint's state) and appends, so each step appears once.
    """

    def _check_log_dir_exists(self) -> None:
        """Nothing is deleted (Lightning's writer removes metrics.csv here)."""

    def save(self) -> None:
        if self.metrics and not self.metrics_keys:  # this writer's first save
            path = Path(self.metrics_file_path)
            drop_steps_from(path, min(int(m["step"]) for m in self.metrics))
            if path.is_file():
                with path.open(newline="", encoding="utf-8") as f:
                    self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])
        super().save()


class ResumingCSVLogger(CSVLogger):
    """`logger=csv`: Lightning's CSVLogger with `ResumingExperimentWriter`, so a resumed run keeps its rows."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumingExperimentWriter(log_dir=self.log_dir)
        return self._experiment


WRITERS: dict[type[Logger], Writer] = {
    TensorBoardLogger: TensorBoardWriter(),
    WandbLogger: WandbWriter(),
    MLFlowLogger: MLflowWriter(),
    CSVLogger: CSVWriter(),
}
"""Logger class -> its writer; a subclass gets its nearest base's. Add your own: WRITERS[MyLogger] = MyWriter()."""
_warned: set[type] = set()


def writer_for(logger_class: type) -> Writer | None:
    """The writer of a logger class (or of its nearest base class in `WRITERS`), None for an unknown logger."""
    return next((WRITERS[c] for c in logger_class.__mro__ if c in WRITERS), None)


def _writers(loggers: Sequence[Logger]) -> list[tuple[Logger, Writer]]:
    out = []
    for lg in loggers:
        writer = writer_for(type(lg))
        if writer is None:
            if type(lg) not in _warned:
                _warned.add(type(lg))
                log.warning("%s: no writer in grpo_lightning.training.tracking.WRITERS; it gets scalars and "
                            "hyperparameters only", type(lg).__name__)  # fmt: skip
            continue
        out.append((lg, writer))
    return out


def log_hparams(loggers: Sequence[Logger], params: Mapping[str, Any]) -> None:
    """The composed config, as each tracker stores parameters (Lightning's `log_hyperparams`)."""
    for lg in loggers:
        lg.log_hyperparams(dict(params))


def log_table(loggers: Sequence[Logger], tag: str, table: Table, step: int) -> None:
    for lg, writer in _writers(loggers):
        writer.table(lg, tag, table, step)


def log_histogram(loggers: Sequence[Logger], tag: str, values: Sequence[float], step: int) -> None:
    for lg, writer in _writers(loggers):
        if not writer.no_histograms:
            writer.histogram(lg, tag, [float(v) for v in values], step)


def log_summary(loggers: Sequence[Logger], metrics: Mapping[str, float], text: str, step: int) -> None:
    """The run's closing summary: its `summary/*` numbers as scalars, its rendering as the tracker's text."""
    for lg in loggers:
        lg.log_metrics(dict(metrics), step=step)
    if text:
        for lg, writer in _writers(loggers):
            writer.text(lg, "summary", text, step)


def describe(loggers: Sequence[Logger]) -> list[str]:
    """Where each tracker keeps the run and how to open it, one line per logger (rank 0)."""
    return [line for lg, writer in _writers(loggers) if (line := writer.describe(lg))]


def close(loggers: Sequence[Logger]) -> None:
    """End each tracker's hold on the process once the run is over (Lightning has finalized the loggers)."""
    for lg, writer in _writers(loggers):
        writer.close(lg)


class SummaryToLoggers(L.Callback):
    """Hands the run's closing summary to the loggers at `teardown`, after the last round and the last evaluation
    and before Lightning finalizes (closes) the loggers; `summarize` computes it (app/train.py passes it)."""

    def __init__(self, summarize: Callable[[], tuple[dict[str, float], str]]) -> None:
        self.summarize = summarize
        """() -> (summary/* metrics, their rendering)."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        metrics, text = self.summarize()
        if metrics:
            log_summary(trainer.loggers, metrics, text, trainer.global_step)
