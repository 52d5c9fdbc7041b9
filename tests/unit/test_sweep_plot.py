"""summary.png of a sweep: the series it draws against hand-computed means and bands, read back from real event
files written by torch's SummaryWriter (2 settings x 2 seeds), its labels, and its fallbacks."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter

from grpo_lightning.studies.sweep import SweepSummary
from grpo_lightning.studies.sweep_plot import plot_sweep_summary

# Exact binary fractions: TensorBoard stores float32, so the hand values below compare exactly.
REWARD = {  # (lr, seed) -> train/reward_mean at optimizer steps 1, 2, 3
    ("0.5", 0): [0.25, 0.5, 0.75],
    ("0.5", 1): [0.75, 1.0, 0.25],
    ("1.0", 0): [0.0, 0.125, 0.5],
    ("1.0", 1): [0.5, 0.375, 1.5],
}
ACCURACY = {("0.5", 0): [0.0, 0.5], ("0.5", 1): [0.25, 0.25], ("1.0", 0): [0.125, 1.0], ("1.0", 1): [0.125, 0.0]}
EVAL_STEPS = (0, 3)


def _job(sweep, number, overrides):
    job = sweep / f"{number}_{','.join(overrides)}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return job


@pytest.fixture
def sweep(tmp_path):
    for number, (lr, seed) in enumerate(REWARD):
        # model=tiny and +data.x=2 are shared by every job; the seed differs within a group
        job = _job(tmp_path, number, ["model=tiny", f"optim.optimizer.lr={lr}", f"seed={seed}", "+data.x=2"])
        writer = SummaryWriter(str(job / "tensorboard"))
        for step, value in enumerate(REWARD[lr, seed], start=1):
            writer.add_scalar("train/reward_mean", value, step)
            writer.add_scalar("train/kl", 9.0, step)  # not a plotted tag
        for step, value in zip(EVAL_STEPS, ACCURACY[lr, seed], strict=True):
            writer.add_scalar("eval/gsm8k_accuracy", value, step)
        writer.close()
    return tmp_path


def test_the_drawn_series_are_the_hand_computed_means_and_bands_per_setting(sweep):
    curves = plot_sweep_summary(sweep)
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [(c.tag, c.label, c.jobs) for c in curves] == [
        ("train/reward_mean", "optim.optimizer.lr=0.5", ["0_model=tiny,optim.optimizer.lr=0.5,seed=0,+data.x=2",
                                                         "1_model=tiny,optim.optimizer.lr=0.5,seed=1,+data.x=2"]),
        ("train/reward_mean", "optim.optimizer.lr=1.0", ["2_model=tiny,optim.optimizer.lr=1.0,seed=0,+data.x=2",
                                                         "3_model=tiny,optim.optimizer.lr=1.0,seed=1,+data.x=2"]),
        ("eval/gsm8k_accuracy", "optim.optimizer.lr=0.5", curves[0].jobs),
        ("eval/gsm8k_accuracy", "optim.optimizer.lr=1.0", curves[1].jobs),
    ]  # fmt: skip
    reward_05, reward_10, acc_05, acc_10 = curves
    assert reward_05.steps == [1, 2, 3]
    assert reward_05.mean == [0.5, 0.75, 0.5]  # (0.25+0.75)/2, (0.5+1.0)/2, (0.75+0.25)/2
    assert (reward_05.low, reward_05.high) == ([0.25, 0.5, 0.25], [0.75, 1.0, 0.75])
    assert reward_10.mean == [0.25, 0.25, 1.0]  # (0+0.5)/2, (0.125+0.375)/2, (0.5+1.5)/2
    assert (reward_10.low, reward_10.high) == ([0.0, 0.125, 0.5], [0.5, 0.375, 1.5])
    assert acc_05.steps == [0, 3] and acc_05.mean == [0.125, 0.375] and acc_05.high == [0.25, 0.5]
    assert acc_10.mean == [0.125, 0.5] and acc_10.low == [0.125, 0.0] and acc_10.high == [0.125, 1.0]


def test_labels_name_every_override_that_differs_between_groups_and_none_that_all_share(tmp_path):
    settings = [["loss=grpo", "seed=0"], ["loss=grpo", "seed=1"], ["loss=dapo", "lr=2", "seed=0"], ["seed=0"]]
    for number, overrides in enumerate(settings):
        job = _job(tmp_path, number, ["model=tiny", *overrides])
        (job / "final_metrics.json").write_text(json.dumps({"train/reward_mean": float(number)}))
    curves = plot_sweep_summary(tmp_path, tags=("train/reward_mean",))
    # loss differs (grpo, dapo, not set); lr is set by one group only; model=tiny is shared; seed pools jobs
    assert [(c.label, c.mean) for c in curves] == [("loss=grpo", [0.5]), ("loss=dapo lr=2", [2.0]), ("", [3.0])]


def test_jobs_without_event_files_fall_back_to_metrics_csv_then_final_metrics(tmp_path):
    csv_job = _job(tmp_path, 0, ["loss=a"])
    (csv_job / "csv" / "version_0").mkdir(parents=True)
    (csv_job / "csv" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/reward_mean,eval/gsm8k_accuracy\n0,1,0.5,\n0,1,,0.25\n1,4,0.75,\n"
    )
    final_job = _job(tmp_path, 1, ["loss=b"])
    (final_job / "final_metrics.json").write_text(json.dumps({"train/reward_mean": 0.125, "eval/gsm8k_accuracy": 1}))
    curves = plot_sweep_summary(tmp_path)
    by = {(c.tag, c.label): (c.steps, c.mean) for c in curves}
    assert by[("train/reward_mean", "loss=a")] == ([1, 4], [0.5, 0.75])
    assert by[("eval/gsm8k_accuracy", "loss=a")] == ([1], [0.25])
    # a final value alone is drawn at the last step any job logged
    assert by[("train/reward_mean", "loss=b")] == ([4], [0.125])
    assert by[("eval/gsm8k_accuracy", "loss=b")] == ([4], [1.0])
    assert (tmp_path / "summary.png").is_file()


def test_without_matplotlib_one_line_is_logged_and_the_sweep_summary_still_succeeds(sweep, monkeypatch, caplog):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with caplog.at_level(logging.INFO):
        SweepSummary().on_multirun_end(config)
    assert not (sweep / "summary.png").exists()
    assert (sweep / "summary.md").is_file()
    lines = [r.getMessage() for r in caplog.records if "summary.png" in r.getMessage()]
    assert lines == ["summary.png not written: matplotlib is not installed (pip install 'grpo_lightning[analysis]')"]


def test_a_failing_picture_never_fails_the_sweep(sweep, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("grpo_lightning.studies.sweep_plot.plot_sweep_summary", broken)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with caplog.at_level(logging.WARNING):
        SweepSummary().on_multirun_end(config)
    assert (sweep / "summary.md").is_file()
    assert [r.getMessage() for r in caplog.records] == ["summary.png not written: RuntimeError: disk full"]
