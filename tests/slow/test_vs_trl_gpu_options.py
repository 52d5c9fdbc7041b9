"""benchmarks/vs_trl.py's options for GPU sizes, dry-run on the CPU with the random tiny model: three systems, one
process each, `--fixed-length` holding every completion at `--max-new` tokens on both sides (the truth: the length
asked for), full fine-tuning, and `--merge` rebuilding the table from runs saved one system at a time. TRL is the
benchmark-only `bench` extra: skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

WORK = ["--model", "tiny", "--steps", "2", "--group", "2", "--prompts", "2", "--micro", "2", "--max-new", "6"]


def vs_trl(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "benchmarks/vs_trl.py", *WORK, *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("full", [False, True])
def test_three_systems_at_a_fixed_length(tmp_path, full):
    pytest.importorskip("trl")
    out = tmp_path / "runs.json"
    systems = ["trl", "ours_eager", "ours"]
    options = ["--fixed-length", *(["--full"] if full else [])]
    proc = vs_trl(*options, "--systems", *systems, "--json", str(out))
    results = json.loads(out.read_text())
    assert list(results) == systems
    for name, r in results.items():
        assert r["completion_len"] == [6.0, 6.0], name  # every completion of every step: --max-new tokens
        assert len(r["step_s"]) == len(r["rollout_s"]) == len(r["generate_s"]) == 2, name
    assert "model.lora.enabled=false" in proc.stdout if full else "model.lora.enabled" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ratio grpo_lightning")]
    assert len(lines) == 2  # eager and default, each against TRL

    # one system per file, merged: the same table as the run that held all three
    for name, r in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({name: r}))
    merged = vs_trl(*options, "--merge", *(str(tmp_path / f"{n}.json") for n in systems))
    caption = proc.stdout.rindex("\n", 0, proc.stdout.index(": tiny, "))  # the line "<device (flags)>: tiny, ..."
    table = proc.stdout[caption:]
    assert merged.stdout.strip() == table.strip()
