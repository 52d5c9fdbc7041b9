"""training/tracking.py: one call per kind of record reaches every logger in its tracker's own type.

Truth: hand-written Markdown (the TensorBoard table as it was written before the fan-out existed), the values
handed in (read back from TensorBoard's event file and from the CSV files with their own readers), and hand-made
logger classes for the dispatch. End-to-end runs with W&B and MLflow: tests/test_tracking_runs.py.
"""

from __future__ import annotations

import csv
import logging

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.validation import check_logger_packages
from grpo_lightning.training import tracking
from grpo_lightning.training.tracking import Column, Table
from tests.conftest import make_cfg

COLUMNS = (Column("group"), Column("reward", ".2f"), Column("advantage", "+.2f"), Column("question", max_chars=8),
           Column("completion"))  # fmt: skip
ROWS = ((0, 0.5, 1.25, "How many | eggs?", "line one\nline | two"), (3, 1.0, -0.5, "Short", "#### 7"))


def test_markdown_table_reads_as_before():
    """Formats, escapes (pipes, newlines) and cuts (with an ellipsis) as the rollout table always did."""
    expected = (
        "| group | reward | advantage | question | completion |\n"
        "|---|---|---|---|---|\n"
        "| 0 | 0.50 | +1.25 | How man… | line one<br>line \\| two |\n"
        "| 3 | 1.00 | -0.50 | Short | #### 7 |"
    )
    assert Table(COLUMNS, ROWS).markdown() == expected


def test_tensorboard_and_csv_get_each_kind_in_their_own_type(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tensorboard", version="")
    table_csv = CSVLogger(tmp_path, name="csv", version="")
    loggers = [tb, table_csv]
    table = Table(COLUMNS, ROWS)
    tracking.log_table(loggers, "rollout/samples", table, step=2)
    tracking.log_table(loggers, "rollout/samples", Table(COLUMNS, ROWS[1:]), step=4)
    tracking.log_histogram(loggers, "rollout/reward_hist", [0.25, 0.5, 0.5, 1.0], step=2)
    tracking.log_summary(loggers, {"summary/train_reward_end": 0.75}, "run summary:\n  a -> b", step=4)
    for lg in loggers:
        lg.finalize("success")

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("rollout/samples/text_summary")]
    assert texts[0] == (2, table.markdown())
    assert texts[1][0] == 4
    hist = acc.Histograms("rollout/reward_hist")[0]
    assert (hist.step, hist.histogram_value.num, hist.histogram_value.sum) == (2, 4, 2.25)
    assert hist.histogram_value.min == 0.25 and hist.histogram_value.max == 1.0
    assert [(e.step, e.value) for e in acc.Scalars("summary/train_reward_end")] == [(4, 0.75)]
    summary = acc.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == "    run summary:\n      a -> b"  # an indented (preformatted) block

    with open(tmp_path / "csv" / "rollout" / "samples.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "group", "reward", "advantage", "question", "completion"]
    assert rows[1:] == [
        ["2", "0", "0.5", "1.25", "How many | eggs?", "line one\nline | two"],
        ["2", "3", "1.0", "-0.5", "Short", "#### 7"],
        ["4", "3", "1.0", "-0.5", "Short", "#### 7"],
    ]
    assert (tmp_path / "csv" / "summary.txt").read_text() == "run summary:\n  a -> b\n"
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        metrics = list(csv.DictReader(f))
    assert [(m["step"], float(m["summary/train_reward_end"])) for m in metrics] == [("4", 0.75)]
    assert not (tmp_path / "csv" / "rollout" / "reward_hist.csv").exists()  # CSV: no histogram type


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_csv_run_keeps_the_rows_logged_before_its_checkpoint(tmp_path):
    """Lightning's CSV writer deletes metrics.csv when its folder is not empty (a run resumed in its own output
    directory); ResumingCSVLogger keeps the earlier attempt's rows before the first step the resumed attempt logs,
    and the resumed attempt's rows from there on (each step once), in metrics.csv and in the table files."""
    first = tracking.ResumingCSVLogger(tmp_path, name="csv", version="")
    for step in range(5):  # the first attempt: steps 0..4, the checkpoint was at step 3
        first.log_metrics({"a": float(step)}, step=step)
    tracking.log_table([first], "rollout/samples", Table(COLUMNS, ROWS[:1]), step=2)
    tracking.log_table([first], "rollout/samples", Table(COLUMNS, ROWS[:1]), step=4)
    first.finalize("failed")

    resumed = tracking.ResumingCSVLogger(tmp_path, name="csv", version="")
    for step in (3, 4, 5):
        resumed.log_metrics({"a": 10.0 * step, "b": 1.0}, step=step)
    tracking.log_table([resumed], "rollout/samples", Table(COLUMNS, ROWS[1:]), step=4)
    resumed.finalize("success")

    rows = csv_rows(tmp_path / "csv" / "metrics.csv")
    assert [(r["step"], r["a"], r["b"]) for r in rows] == [
        ("0", "0.0", ""), ("1", "1.0", ""), ("2", "2.0", ""), ("3", "30.0", "1.0"), ("4", "40.0", "1.0"),
        ("5", "50.0", "1.0"),
    ]  # fmt: skip
    samples = csv_rows(tmp_path / "csv" / "rollout" / "samples.csv")
    assert [(r["step"], r["group"]) for r in samples] == [("2", "0"), ("4", "3")]


def test_a_fresh_csv_run_writes_what_lightnings_logger_writes(tmp_path):
    ours = tracking.ResumingCSVLogger(tmp_path, name="ours", version="")
    theirs = CSVLogger(tmp_path, name="theirs", version="")
    for lg in (ours, theirs):
        lg.log_metrics({"a": 1.0}, step=0)
        lg.log_metrics({"a": 2.0, "b": 3.0}, step=1)
        lg.finalize("success")
    assert csv_rows(tmp_path / "ours" / "metrics.csv") == csv_rows(tmp_path / "theirs" / "metrics.csv")


class Recorder(tracking.Writer):
    def __init__(self):
        self.calls = []

    def table(self, logger, tag, table, step):
        self.calls.append(("table", type(logger).__name__, tag, step))

    def histogram(self, logger, tag, values, step):
        self.calls.append(("histogram", type(logger).__name__, tag, values))


class Quiet(Logger):
    """A Lightning logger the mapping does not know."""

    name = "quiet"
    version = 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class MyTensorBoard(TensorBoardLogger):
    pass


def test_dispatch_is_by_logger_class(tmp_path, monkeypatch, caplog):
    """The nearest class in WRITERS decides (a subclass inherits its base's writer); an unknown logger is
    skipped with one warning; a writer that states why it has no histograms gets none."""
    recorder = Recorder()
    no_histograms = Recorder()
    no_histograms.no_histograms = "no histogram type"
    monkeypatch.setitem(tracking.WRITERS, TensorBoardLogger, recorder)
    monkeypatch.setitem(tracking.WRITERS, CSVLogger, no_histograms)
    loggers = [MyTensorBoard(tmp_path), Quiet(), CSVLogger(tmp_path)]
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        tracking.log_table(loggers, "t", Table(COLUMNS, ROWS), 5)
    tracking.log_histogram(loggers, "h", [1, 2], 5)
    histogram = ("histogram", "MyTensorBoard", "h", [1.0, 2.0])
    assert recorder.calls == [("table", "MyTensorBoard", "t", 5)] * 2 + [histogram]
    assert no_histograms.calls == [("table", "CSVLogger", "t", 5)] * 2
    assert [r.getMessage() for r in caplog.records if "Quiet" in r.getMessage()] == [
        "Quiet: no writer in grpo_lightning.training.tracking.WRITERS; it gets scalars and hyperparameters only"
    ]


def test_a_missing_tracker_package_fails_in_one_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    check_logger_packages(make_cfg(tmp_path, ["logger=[tensorboard,mlflow]"]))  # installed: no complaint
    with pytest.raises(ValueError) as err:
        check_logger_packages(make_cfg(tmp_path, ["logger=[tensorboard,wandb]"]))
    assert str(err.value) == (
        "logger.wandb needs the wandb package: pip install 'grpo_lightning[wandb]' (from a checkout: pip install "
        "-e '.[wandb]'), or leave wandb out of logger=[...]"
    )


def test_the_group_selects_several_loggers_in_order(tmp_path):
    from grpo_lightning.app.parts import build_loggers

    assert list(make_cfg(tmp_path).logger) == ["tensorboard"]
    assert list(make_cfg(tmp_path, ["logger=[csv,tensorboard]"]).logger) == ["csv", "tensorboard"]
    assert [type(lg).__name__ for lg in build_loggers(make_cfg(tmp_path, ["logger=[csv,tensorboard]"]))] == [
        "ResumingCSVLogger",
        "TensorBoardLogger",
    ]
    assert build_loggers(make_cfg(tmp_path, ["logger=[]"])) == []


def test_a_setting_a_tracker_refuses_fails_before_the_model_loads(tmp_path, monkeypatch):
    """W&B cannot upload checkpoints offline: Lightning's WandbLogger refuses the pair, and the run reports it in
    one line naming the node, before any model is loaded (loggers are built before the model)."""
    from grpo_lightning.app.train import build_run
    from grpo_lightning.models import sources

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the loggers were built")

    monkeypatch.setattr(sources.RandomSource, "load", fail)
    cfg = make_cfg(tmp_path, ["model=tiny", "logger=[tensorboard,wandb]", "logger.wandb.log_model=true"])
    with pytest.raises(ValueError) as err:
        build_run(cfg)
    assert str(err.value).startswith("logger.wandb: Providing log_model=True and offline=True is an invalid")
