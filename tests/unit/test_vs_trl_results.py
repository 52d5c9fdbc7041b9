"""benchmarks/vs_trl.py's results: `--json` writes, beside each system's timings, the facts of the run that produced
them (`run_facts`), and `--merge` captions and rates the table from those facts, never from its own flags (whose
defaults are the CPU run's), and refuses files that are not the same work on the same device. Hand-written facts
and timings: no model, no TRL."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.helpers import load_benchmark

BENCH = load_benchmark("vs_trl")
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: Test EPYC 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile

processor\t: 1
model name\t: Test EPYC 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile
"""
H100 = "NVIDIA H100 80GB HBM3"
VERSIONS = {"torch": "2.9.0", "transformers": "4.57.1", "peft": "0.17.1", "lightning": "2.5.5", "cuda": "12.8"}


def bench_args(**given) -> argparse.Namespace:
    """The flags `run_facts` reads, as `main` leaves them (`--gpu` implies `--bf16`)."""
    args = {
        "gpu": False,
        "bf16": False,
        "model": None,
        "full": False,
        "loss": "grpo",
        "steps": 4,
        "group": 4,
        "prompts": 4,
        "max_new": 128,
        "micro": 4,
        "fixed_length": False,
        "ours_override": [],
        "tokenizer_dir": None,
    }
    return argparse.Namespace(**(args | given))


def test_cpu_facts_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    monkeypatch.delitem(sys.modules, "trl", raising=False)  # ours' subprocess never imports it
    facts = BENCH.run_facts(bench_args(full=True, steps=3, prompts=2, micro=8, max_new=64), cpuinfo)
    assert facts["device"] == "Test EPYC 9000"
    assert facts["cpu_flags"] == ["avx2", "avx512f", "amx_tile"]  # no avx512_bf16 on this one
    assert facts["gpu"] is False
    assert facts["model"] == "smollm2_135m"  # no --model: the embedded default preset
    assert facts["tuning"] == "full"
    assert (facts["loss"], facts["steps"], facts["group"], facts["prompts"]) == ("grpo", 3, 4, 2)
    assert (facts["max_new"], facts["micro"], facts["fixed_length"], facts["dtype"]) == (64, 8, False, "fp32")
    assert facts["ours_override"] == []
    packages = ("torch", "transformers", "peft", "lightning")
    assert facts["versions"] == {name: version(name) for name in packages}  # no trl, no CUDA
    assert set(facts) == set(BENCH.FACT_KEYS)


def test_gpu_facts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="1.16.0"))  # TRL's subprocess
    args = bench_args(
        gpu=True,
        bf16=True,
        model="random_qwen0.5b",
        group=8,
        prompts=8,
        max_new=256,
        micro=16,
        fixed_length=True,
        ours_override=["perf.forward.chunk=2"],
    )
    facts = BENCH.run_facts(args)
    assert (facts["device"], facts["cpu_flags"], facts["gpu"]) == (H100, None, True)
    assert (facts["model"], facts["tuning"], facts["dtype"]) == ("random_qwen0.5b", "lora", "bf16")
    assert (facts["group"], facts["prompts"], facts["max_new"], facts["micro"]) == (8, 8, 256, 16)
    assert facts["fixed_length"] is True
    assert facts["ours_override"] == ["perf.forward.chunk=2"]
    assert facts["versions"]["trl"] == "1.16.0"
    assert facts["versions"]["cuda"] == "12.8"
    assert facts["versions"]["torch"] == version("torch")


def test_child_writes_the_facts_beside_the_timings(tmp_path, monkeypatch):
    timings = {"system": "grpo_lightning", "step_s": [2.0, 1.0], "rollout_s": [1.0, 0.5], "train_s": [1.0, 0.5]}
    monkeypatch.setattr(BENCH, "run_ours", lambda pinned, extra, fixed_length=False: dict(timings))
    out = tmp_path / "ours.json"
    BENCH.child(bench_args(child="ours", out=str(out), steps=2, group=8, prompts=2, micro=8))
    entry = json.loads(out.read_text())
    assert entry["step_s"] == [2.0, 1.0] and entry["system"] == "ours"
    assert (entry["group"], entry["prompts"], entry["steps"], entry["tuning"]) == (8, 2, 2, "lora")
    assert set(BENCH.FACT_KEYS) <= set(entry)


def gpu_entry(generate_s: list[float], step_s: list[float], **facts) -> dict:
    """One system's entry as `--json` writes it on a GPU: timings (seconds per step) and the run's facts."""
    entry = {
        "step_s": step_s,
        "rollout_s": [s * 0.6 for s in step_s],
        "train_s": [s * 0.4 for s in step_s],
        "generate_s": generate_s,
        "completion_len": [256.0] * len(step_s),
        "peak_rss_gb": 3.0,
        "peak_gpu_gb": 20.0,
        "wall_s": 60.0,
        "device": H100,
        "cpu_flags": None,
        "gpu": True,
        "model": "random_qwen0.5b",
        "tuning": "lora",
        "loss": "grpo",
        "steps": len(step_s),
        "group": 8,
        "prompts": 8,
        "max_new": 256,
        "micro": 16,
        "fixed_length": True,
        "dtype": "bf16",
        "ours_override": [],
        "versions": VERSIONS,
    }
    return entry | facts


def write(path: Path, entries: dict) -> str:
    path.write_text(json.dumps(entries))
    return str(path)


def merge(monkeypatch, *paths: str, flags: tuple[str, ...] = ()) -> None:
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--merge", *paths, *flags])
    BENCH.main()


def table_rows(out: str) -> dict[str, list[str]]:
    """The table's rows by their first cell (the system's name), each row's cells."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| system"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def test_merge_captions_and_rates_from_the_recorded_facts(tmp_path, monkeypatch, capsys):
    trl = gpu_entry([3.0, 2.0, 2.5, 2.0], [9.0, 5.0, 6.0, 5.5])
    trl["versions"] = trl["versions"] | {"trl": "1.16.0"}
    ours = gpu_entry([1.0, 0.5, 0.4, 0.5], [4.0, 2.0, 2.2, 2.1], peak_gpu_gb=12.0, gpu_estimate_gb=13.5)
    paths = write(tmp_path / "trl.json", {"trl": trl}), write(tmp_path / "ours.json", {"ours": ours})
    merge(monkeypatch, *paths)  # no flag says GPU, model or sizes
    out = capsys.readouterr().out
    merge(monkeypatch, *paths, flags=("--group", "3", "--micro", "5", "--max-new", "7"))  # ignored, not checked
    assert capsys.readouterr().out == out
    caption = next(line for line in out.splitlines() if line.startswith(H100))
    assert "random_qwen0.5b" in caption and "LoRA r16" in caption
    assert "8 prompts x 8 completions" in caption and "256 new tokens (fixed)" in caption
    assert "micro-batches of 16" in caption and "bf16" in caption and "4 steps" in caption
    assert "SmolLM2" not in out and "fp32" not in out and "4 prompts x 4" not in out  # not the CPU defaults
    assert "trl 1.16.0" in out and "cuda 12.8" in out
    # rollout tokens/s: prompts x group x max_new tokens a step (fixed length), over the median generation seconds
    # of the steps after the first: 8 x 8 x 256 = 16384 tokens; TRL's median of 2.0, 2.5, 2.0 = 2.0 s, ours' 0.5 s
    tokens = 8 * 8 * 256
    assert tokens / statistics.median([2.0, 2.5, 2.0]) == 8192
    rows = table_rows(out)
    columns = ["step s", "rollout s", "train s", "rollout tokens/s", "peak GPU GiB", "GPU estimate GiB"]
    rate = 1 + columns.index("rollout tokens/s")
    assert rows["TRL GRPOTrainer"][rate] == "8192"
    assert rows["grpo_lightning"][rate] == f"{tokens / 0.5:.0f}" == "32768"
    assert rows["grpo_lightning"][1 + columns.index("step s")] == f"{statistics.median([2.0, 2.2, 2.1]):.2f}"
    assert rows["grpo_lightning"][1 + columns.index("GPU estimate GiB")] == "13.50"
    assert rows["ratio grpo_lightning / TRL"][rate] == "4.00"


def test_merge_rates_a_free_length_run_by_its_mean_length(tmp_path, monkeypatch, capsys):
    ours = gpu_entry([1.0, 0.5, 0.4, 0.5], [4.0, 2.0, 2.2, 2.1], fixed_length=False)
    ours["completion_len"] = [100.0, 120.0, 90.0, 110.0]
    merge(monkeypatch, write(tmp_path / "ours.json", {"ours": ours}))
    out = capsys.readouterr().out
    assert "256 new tokens," in out and "(fixed)" not in out
    rate = 8 * 8 * statistics.mean([100.0, 120.0, 90.0, 110.0]) / 0.5  # 8 x 8 x 105 tokens over 0.5 s
    assert table_rows(out)["grpo_lightning"][4] == f"{rate:.0f}" == "13440"


def test_merge_refuses_different_work(tmp_path, monkeypatch, capsys):
    trl = write(tmp_path / "trl.json", {"trl": gpu_entry([3.0, 2.0], [9.0, 5.0])})
    ours = write(tmp_path / "ours.json", {"ours": gpu_entry([1.0, 0.5], [4.0, 2.0], group=4, max_new=128)})
    with pytest.raises(SystemExit) as refused:
        merge(monkeypatch, trl, ours)
    message = str(refused.value)
    assert "\n" not in message and "not the same work" in message
    assert f"group 8 (trl in {trl}) vs 4 (ours in {ours})" in message
    assert f"max_new 256 (trl in {trl}) vs 128 (ours in {ours})" in message
    assert "prompts" not in message and "model" not in message  # only what differs
    assert capsys.readouterr().out == ""  # no table


def test_merge_refuses_another_device(tmp_path, monkeypatch):
    trl = write(tmp_path / "trl.json", {"trl": gpu_entry([3.0, 2.0], [9.0, 5.0])})
    ours = write(tmp_path / "ours.json", {"ours": gpu_entry([1.0, 0.5], [4.0, 2.0], device="NVIDIA H200")})
    with pytest.raises(SystemExit, match="device 'NVIDIA H100 80GB HBM3' .* vs 'NVIDIA H200'"):
        merge(monkeypatch, trl, ours)


def test_merge_refuses_entries_without_facts(tmp_path, monkeypatch, capsys):
    old = {key: value for key, value in gpu_entry([3.0, 2.0], [9.0, 5.0]).items() if key not in BENCH.FACT_KEYS}
    path = write(tmp_path / "old.json", {"trl": old})
    with pytest.raises(SystemExit, match=r"old\.json: entry 'trl' lacks the run facts \(missing: all of them\)"):
        merge(monkeypatch, path)
    assert capsys.readouterr().out == ""


def test_trl_liger_is_a_system_of_its_own():
    assert BENCH.SYSTEM_NAMES["trl_liger"] == "TRL GRPOTrainer, Liger kernel"
    assert len(set(BENCH.SYSTEM_NAMES.values())) == len(BENCH.SYSTEM_NAMES)  # every row named distinctly
    assert BENCH.TRL_SYSTEMS["trl_liger"] == {"use_liger_kernel": True}


def without_liger(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # `import liger_kernel` raises ImportError


def test_trl_liger_without_liger_stops_with_one_line(tmp_path, monkeypatch):
    without_liger(monkeypatch)
    monkeypatch.setattr(BENCH, "run_trl", lambda *a, **k: pytest.fail("TRL started without Liger"))
    out = tmp_path / "trl_liger.json"
    args = bench_args(child="trl_liger", out=str(out), gpu=True, bf16=True, trl_no_gc=False)
    with pytest.raises(SystemExit) as stopped:
        BENCH.child(args)
    assert str(stopped.value) == BENCH.LIGER_MISSING
    assert BENCH.LIGER_MISSING == (
        "trl_liger needs liger-kernel: ../shared/tools/gpu-bundle liger-kernel==0.8.5 adds its wheel"
    )
    assert not out.exists()


def test_trl_liger_child_process_prints_one_line(tmp_path):
    """The child as the parent starts it: exit code 1 and the one line on stderr, no traceback."""
    script = ROOT / "benchmarks" / "vs_trl.py"
    argv = [str(script), "--gpu", "--systems", "trl_liger", "--child", "trl_liger", "--out", str(tmp_path / "x.json")]
    code = (
        "import runpy, sys; sys.modules['liger_kernel'] = None; "
        f"sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == BENCH.LIGER_MISSING
    assert not (tmp_path / "x.json").exists()


def test_trl_liger_child_runs_trl_with_the_liger_kernel(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    calls = []

    def fake_run_trl(pinned, gc, model_choice=(), gpu=False, full=False, fixed_length=False, system="trl"):
        calls.append((gpu, fixed_length, system))
        return {"system": system, "step_s": [2.0, 1.0], "rollout_s": [1.0, 0.5], "train_s": [1.0, 0.5]}

    monkeypatch.setattr(BENCH, "run_trl", fake_run_trl)
    out = tmp_path / "trl_liger.json"
    args = bench_args(child="trl_liger", out=str(out), gpu=True, bf16=True, fixed_length=True, trl_no_gc=False)
    BENCH.child(args)
    assert calls == [(True, True, "trl_liger")]
    entry = json.loads(out.read_text())
    assert entry["system"] == "trl_liger" and entry["device"] == H100
    assert "liger-kernel" in entry["versions"]  # imported in its subprocess: recorded


def test_trl_liger_needs_the_gpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--systems", "trl", "trl_liger"])
    with pytest.raises(SystemExit) as refused:
        BENCH.main()
    assert refused.value.code == 2
    assert "trl_liger runs Liger's Triton kernels: only with --gpu" in capsys.readouterr().err


def test_merge_rates_ours_against_trl_and_against_trl_liger(tmp_path, monkeypatch, capsys):
    trl = gpu_entry([3.0, 2.0, 2.0], [9.0, 6.0, 6.0], peak_gpu_gb=4.0)
    liger = gpu_entry([3.0, 2.0, 2.0], [8.0, 4.0, 4.0], peak_gpu_gb=2.0)
    ours = gpu_entry([1.0, 0.5, 0.5], [4.0, 3.0, 3.0], peak_gpu_gb=8.0, gpu_estimate_gb=9.0)
    paths = (
        write(tmp_path / "trl.json", {"trl": trl, "ours": ours}),
        write(tmp_path / "liger.json", {"trl_liger": liger}),
    )
    merge(monkeypatch, *paths)
    rows = table_rows(capsys.readouterr().out)
    assert rows["TRL GRPOTrainer, Liger kernel"][1] == "4.00"  # its own row, by its name
    assert rows["ratio grpo_lightning / TRL"][1] == "0.50"  # step: 3.0 / 6.0
    assert rows["ratio grpo_lightning / TRL, Liger kernel"][1] == "0.75"  # step: 3.0 / 4.0
    assert rows["ratio grpo_lightning / TRL, Liger kernel"][5] == "4.00"  # peak GPU: 8.0 / 2.0
    assert not any(name.startswith("ratio TRL") for name in rows)

    merge(monkeypatch, paths[1], write(tmp_path / "ours.json", {"ours": ours}))  # no plain TRL row
    rows = table_rows(capsys.readouterr().out)
    assert "ratio grpo_lightning / TRL" not in rows
    assert rows["ratio grpo_lightning / TRL, Liger kernel"][1] == "0.75"
