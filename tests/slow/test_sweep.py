"""A Hydra multirun on the tiny model: separate job dirs, a summary with one row per job and its picture, and the
notebook."""

import csv
import os
from pathlib import Path

import pytest

from tests.forked_cli import cli_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("sweep")
    result = cli_run(
        "-m", "model=tiny", "seed=0,1", "trainer.max_epochs=2", "generator.max_new_tokens=16", "eval.num_problems=4",
        "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep}", cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep


def test_jobs_have_their_own_dirs_and_the_summary_has_one_row_each(sweep_dir):
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(jobs) == 2  # named by job number and overrides
    assert jobs[0].name.startswith("0_") and "seed=0" in jobs[0].name and "seed=1" in jobs[1].name
    for job in jobs:
        assert (job / "tensorboard").is_dir() and (job / "checkpoints" / "last.ckpt").is_file()
        assert (job / "final_metrics.json").is_file()
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [r["job"] for r in rows] == [p.name for p in jobs]
    assert all(r["eval/gsm8k_accuracy"] != "" for r in rows)
    assert (sweep_dir / "summary.md").read_text().count("\n") == 4  # header, rule, two rows
    assert (sweep_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curves, seeds pooled


def test_notebook_runs_top_to_bottom_on_the_sweep(sweep_dir):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    os.environ["GRPO_SWEEP_DIR"] = str(sweep_dir)  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        del os.environ["GRPO_SWEEP_DIR"]
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "2 runs: {'grpo': 2}" in outputs
    assert (sweep_dir / "compare_runs.png").is_file()
