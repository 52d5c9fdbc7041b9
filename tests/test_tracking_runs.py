"""logger=wandb, mlflow, csv and several at once, end to end on the tiny model, read back with each tracker's own
reader, offline: what a tracker holds equals what the run logged (TensorBoard's event file, the CSV files, the
run's returned metrics).

W&B runs offline (no network here): its run folder holds a `.wandb` file, a LevelDB-style log of protobuf
records (wandb 0.31 ships no Python reader; `wandb_records` below reads the format, checking each chunk's CRC).
MLflow writes a SQLite store in the run directory, read back through `MlflowClient`. Every tracker's state lands
under tmp_path (the W&B and MLflow environment variables point there; `tracker_env`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.train import train
from tests.test_docs import read_markdown

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    """W&B offline and quiet, its caches and settings under tmp_path; no MLflow telemetry; no credentials."""
    home = tmp_path / "tracker_home"
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return home


# ---- readers ---------------------------------------------------------------------------------------------------------
def wandb_records(path: Path):
    """The protobuf records of a `.wandb` file: a 7-byte header (":W&B", 0xBEE1, version), then 32 KiB blocks of
    chunks (CRC-32 of type + data, length, type: 1 full, 2 first, 3 middle, 4 last), as LevelDB's log format."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            return
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc
        pos, pending = pos + 7 + length, pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(output_dir: Path) -> tuple[Path, list[dict], dict]:
    """The offline run's folder, its history rows and its config."""
    (folder,) = (output_dir / "wandb").glob("offline-run-*")
    path = next(folder.glob("run-*.wandb"))
    deadline = time.monotonic() + 60
    while True:  # W&B's service process may still be writing when run.finish() returns: wait for the exit record
        records = list(wandb_records(path))
        if records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history, config = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return folder, history, config


def tensorboard(output_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(output_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def csv_metrics(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series = defaultdict(list)
    with open(output_dir / "csv" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value != "":
                    series[key].append((int(row["step"]), float(value)))
    return series


def markdown_rows(text: str) -> list[list[str]]:
    return [line.strip("| ").split(" | ") for line in text.splitlines()[2:]]


# ---- runs ------------------------------------------------------------------------------------------------------------
def test_wandb_offline_holds_what_tensorboard_holds(tiny_cfg, tracker_env):
    """logger=[tensorboard,wandb]: every scalar series, the config, the sample tables, the histograms and the
    summary reach both; W&B's equal TensorBoard's (float32 there, so to its precision)."""
    cfg = tiny_cfg("logger=[tensorboard,wandb]")
    metrics = train(cfg)
    output_dir = Path(cfg.paths.output_dir)
    folder, history, config = wandb_run(output_dir)
    acc = tensorboard(output_dir)

    logged = defaultdict(list)
    for row in history:
        for key, value in row.items():
            if isinstance(value, int | float) and not key.startswith(("_", "trainer/")):
                logged[key].append((row["trainer/global_step"], value))
    scalars = acc.Tags()["scalars"]
    assert "train/reward_mean" in scalars and "summary/train_reward_end" in scalars
    for tag in scalars:
        expected = [(e.step, e.value) for e in acc.Scalars(tag)]
        got = logged[tag]
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        close = [math.isclose(g, e, rel_tol=1e-6, abs_tol=1e-7) for (_, g), (_, e) in zip(got, expected, strict=True)]
        assert all(close), tag
    assert logged["summary/train_reward_end"][-1][1] == metrics["summary/train_reward_end"]  # the run's own value
    assert config["optim"]["optimizer"]["lr"] == 1e-3 and config["model"]["source"]["hidden_size"] == 64

    tables = {(row["trainer/global_step"], key[: -len("/path")]): row[key] for row in history for key in row
              if key.endswith("/path") and row.get(key[: -len("/path")] + "/_type") == "table-file"}  # fmt: skip
    for tag in ("rollout/samples", "eval/samples"):
        texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")}
        assert sorted(step for step, t in tables if t == tag) == sorted(texts), tag
        for step, text in texts.items():
            table = json.loads((folder / "files" / tables[step, tag]).read_text())
            cells = markdown_rows(text)
            assert len(cells) == len(table["data"]) == 4  # logging.num_samples_logged, eval.num_samples_logged
            for row, md in zip(table["data"], cells, strict=True):
                if tag == "rollout/samples":
                    assert md[:3] == [str(row[0]), f"{row[1]:.2f}", f"{row[2]:+.2f}"]
                else:
                    assert md[:2] == [str(row[0]), row[1]]
    for tag in ("rollout/reward_hist", "rollout/advantage_hist"):
        tb = {e.step: e.histogram_value for e in acc.Histograms(tag)}
        wb = {row["trainer/global_step"]: row for row in history if f"{tag}/values" in row}
        assert sorted(wb) == sorted(tb) and len(tb) == 2
        for step, row in wb.items():
            assert sum(row[f"{tag}/values"]) == tb[step].num == 16  # every rollout of the round
            bins = row[f"{tag}/bins"]
            assert math.isclose(bins[0], tb[step].min, abs_tol=1e-6)
            assert math.isclose(bins[-1], tb[step].max, abs_tol=1e-6)
    path = next(row["summary/path"] for row in history if row.get("summary/_type") == "table-file")
    (text,) = (e.tensor_proto.string_val[0].decode() for e in acc.Tensors("summary/text_summary"))
    unindented = "\n".join(line[4:] for line in text.splitlines())
    assert json.loads((folder / "files" / path).read_text())["data"] == [[unindented]]
    assert text.startswith("    run summary:\n")
    assert folder.is_relative_to(output_dir) and (tracker_env / "wandb_cache_dir").is_dir()


def test_mlflow_and_csv_hold_the_run(tiny_cfg, tracker_env, caplog):
    """logger=[mlflow,csv]: MLflow's metric histories (read through MlflowClient) equal metrics.csv's columns,
    its table artifacts the CSV tables, its summary artifact the CSV summary; the config is its parameters.
    The MLflow read-back of docs/tracking.md runs here, on this run."""
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("logger=[mlflow,csv]", "eval.enabled=false")
    metrics = train(cfg)
    output_dir = Path(cfg.paths.output_dir)
    assert (output_dir / "mlflow.db").is_file()  # the default store, under the run directory (conf/logger)
    client = MlflowClient(f"sqlite:///{output_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo_lightning")
    assert Path(experiment.artifact_location.removeprefix("file://")).is_relative_to(output_dir / "mlartifacts")
    (run,) = client.search_runs([experiment.experiment_id])
    series = csv_metrics(output_dir)
    assert "train/reward_mean" in series and "summary/train_reward_end" in series
    for key, expected in series.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == sorted(expected), key
    assert run.data.metrics["summary/train_reward_end"] == metrics["summary/train_reward_end"]
    assert run.data.params["optim/optimizer/lr"] == "0.001" and run.data.params["seed"] == "0"

    with open(output_dir / "csv" / "rollout" / "samples.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    artifacts = Path(client.download_artifacts(run.info.run_id, "rollout/samples", str(output_dir / "download")))
    steps = sorted(p.name for p in artifacts.iterdir())
    assert steps == ["step_000000.json", "step_000001.json"]  # one table per round, at its first step
    for name in steps:
        table = json.loads((artifacts / name).read_text())
        step = int(name[5:11])
        expected = [[int(r["group"]), float(r["reward"]), float(r["advantage"]), r["question"], r["completion"]]
                    for r in rows if int(r["step"]) == step]  # fmt: skip
        assert table["columns"] == ["group", "reward", "advantage", "question", "completion"]
        assert table["data"] == expected and len(expected) == 4
    text = Path(client.download_artifacts(run.info.run_id, "summary.txt", str(output_dir / "download"))).read_text()
    assert text == (output_dir / "csv" / "summary.txt").read_text().rstrip("\n") and text.startswith("run summary:")

    (example,) = [b.text for b in read_markdown(ROOT / "docs" / "tracking.md").blocks if b.lang == "python"]
    namespace = {}
    exec(example.replace("outputs/2026-01-01/12-00-00-1234", str(output_dir)), namespace)  # noqa: S102
    assert namespace["rewards"] == [v for _, v in series["train/reward_mean"]]
    assert not [r for r in caplog.records if r.getMessage().startswith("Experiment with name")]  # app/quiet.py


@pytest.mark.slow
def test_a_tensorboard_run_imports_no_other_tracker(tmp_path):
    """The trackers' packages load only in runs that use them: importing the application and composing and
    building TensorBoard and CSV loggers leaves wandb and mlflow unimported (each takes a second or two to import)."""
    code = (
        "import sys\n"
        "from grpo_lightning.app.parts import build_loggers\n"
        "from tests.conftest import make_cfg\n"
        f"build_loggers(make_cfg({str(tmp_path)!r}, ['logger=[tensorboard,csv]']))\n"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
