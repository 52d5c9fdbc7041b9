"""Every mistake a user can make at the command line ends in a short message, a non-zero exit, no traceback.

Each case asserts the exit code, the words that name the key or file and what to do, that no "Traceback" is
printed, and that nothing already on disk was touched. `cli()` runs the CLI's own code in-process (Hydra's
compose, then `grpo_lightning.__main__.run`, which is what `main` calls) with the output captured; a few cases
at the end run the real `python -m grpo_lightning` in a subprocess to check what only a process shows: the exit
code and HYDRA_FULL_ERROR.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import open_dict

from grpo_lightning.__main__ import run as run_cli
from tests.conftest import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=tiny",
    "trainer.max_epochs=1",
    "generator.max_new_tokens=8",
    "trainer.enable_progress_bar=false",
    "data.prompts_per_round=2",
    "eval.enabled=false",
]


@pytest.fixture(autouse=True)
def _users_default_environment(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the user's default: no traceback


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m grpo_lightning *args`, in-process: compose as Hydra would, then the CLI's error handling.

    `hydra.run.dir=<dir>` becomes the run's output dir (unless `paths.output_dir` is given); a composition error
    exits 1 with Hydra's message, as the real CLI does.
    """
    overrides = [a for a in args if not a.startswith("hydra.run.dir=")]
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), str(cwd / "outputs"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
        except HydraException as error:
            print(f"{error}\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=err)
            code = 1
        else:
            if not any(a.startswith("paths.output_dir=") for a in overrides):
                with open_dict(cfg):
                    cfg.paths.output_dir = run_dir
            code, _ = run_cli(cfg)
    return subprocess.CompletedProcess(["grpo_lightning", *args], code, out.getvalue(), err.getvalue())


def real_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real command in a subprocess, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the user's default: no traceback
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def assert_clean_failure(result: subprocess.CompletedProcess, *words: str, code: int | None = None) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    if code is not None:
        assert result.returncode == code, output
    assert "Traceback" not in output, output
    for word in words:
        assert word in result.stderr, result.stderr


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- mistakes caught before any model is loaded (dry run and real run alike) ------------------------------------
CONFIG_MISTAKES = [
    ("unknown group option", ["loss=foo"], ["Could not find 'loss/foo'"]),
    ("unknown key", ["generator.num_generation=4"], ["generator.num_generation"]),
    ("missing required key", ["model=local"], ["model.source.path", "Missing mandatory value"]),
    ("wrong type (int)", ["generator.num_generations=four"], ["generator.num_generations must be an integer"]),
    ("wrong type (lr)", ["optim.optimizer.lr=fast"], ["optim.optimizer.lr must be a positive number"]),
    ("group size < 2", ["generator.num_generations=1"], ["generator.num_generations must be >= 2"]),
    ("negative lr", ["optim.optimizer.lr=-0.1"], ["optim.optimizer.lr must be a positive number"]),
    ("max_new_tokens 0", ["generator.max_new_tokens=0"], ["generator.max_new_tokens must be >= 1"]),
    ("negative beta", ["loss.beta=-1"], ["loss.beta must be >= 0"]),
    ("zero prompts", ["data.prompts_per_round=0"], ["data.prompts_per_round must be >= 1"]),
    ("accumulation not dividing", ["trainer.accumulate_grad_batches=3"], ["trainer.accumulate_grad_batches"]),
    ("zero temperature", ["generator.temperature=0"], ["generator.temperature must be > 0"]),
    ("zero eval problems", ["eval.num_problems=0"], ["eval.num_problems must be >= 1"]),
    ("storpo min_steps 0", ["variant=storpo", "variant.min_steps=0"], ["variant.min_steps must be >= 1"]),
    ("unknown target", ["optim.optimizer._target_=torch.optim.Nope"], ["optim.optimizer._target_", "Nope"]),
    ("unknown argument", ["+optim.schedule.speed=2"], ["optim.schedule"]),
    ("missing model path", ["model=local", "model.source.path=/nope"], ["model.source.path is not a directory"]),
    (
        "probe on an incompatible setup",
        ["probe=[gns]", "data.groups_per_micro_batch=4"],
        ["probe=[gns] needs two batch sizes", "data.groups_per_micro_batch"],
    ),
    ("resume from a missing checkpoint", ["ckpt_path=/nope/last.ckpt"], ["ckpt_path", "/nope/last.ckpt"]),
    ("resume=last in a fresh dir", ["ckpt_path=last"], ["ckpt_path=last: no checkpoint", "hydra.run.dir"]),
    ("data path missing", ["data.dataset.source=path"], ["data.dataset.path must be set"]),
    (
        "vLLM with several training processes",
        ["generator=vllm", "trainer=ddp", "trainer.devices=2"],
        ["generator=vllm", "several training processes", "trainer.devices"],
    ),
]


@pytest.mark.parametrize(("overrides", "words"), [c[1:] for c in CONFIG_MISTAKES], ids=[c[0] for c in CONFIG_MISTAKES])
def test_config_mistake(tmp_path, overrides, words):
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, *words)


def test_unwritable_output_dir(tmp_path):
    blocker = write(tmp_path / "a_file", "not a directory")
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", f"paths.output_dir={blocker}/run", cwd=tmp_path)
    assert_clean_failure(result, "paths.output_dir: cannot write", code=2)
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", "no usable GSM8K rows"),
        ("this is not json\n{broken\n", "no usable GSM8K rows"),
        (json.dumps({"question": "What is 1+1?"}) + "\n", "no usable GSM8K rows"),  # a row without an answer
        (json.dumps({"question": "What is 1+1?", "answer": "two"}) + "\n", "no usable GSM8K rows"),  # no '####'
    ],
    ids=["empty file", "malformed lines", "rows without answers", "answers without numbers"],
)
def test_bad_data_file(tmp_path, content, words):
    data = write(tmp_path / "train.jsonl", content)
    result = cli(
        "dry_run=true",
        f"hydra.run.dir={tmp_path}/run",
        "data.dataset.source=path",
        f"data.dataset.path={data}",
        cwd=tmp_path,
    )
    assert_clean_failure(result, words, str(data), code=2)


def test_data_file_not_found(tmp_path):
    result = cli(
        "dry_run=true",
        f"hydra.run.dir={tmp_path}/run",
        "data.dataset.source=path",
        "data.dataset.path=/nope.jsonl",
        cwd=tmp_path,
    )
    assert_clean_failure(result, "data.dataset.path: file not found: /nope.jsonl", code=2)


# ---- mistakes found while loading (real runs) --------------------------------------------------------------------
def test_gguf_package_absent(tmp_path):
    result = cli(f"hydra.run.dir={tmp_path}/run", "model.source.package=llm_not_installed", cwd=tmp_path)
    assert_clean_failure(result, "model.source.package 'llm_not_installed' is not installed", "pip install", code=2)


def test_fresh_run_into_a_run_dir_never_overwrites_it(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"an earlier run's checkpoint")
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert_clean_failure(result, "already holds a run", "ckpt_path=last", code=2)
    assert ckpt.read_bytes() == b"an earlier run's checkpoint"


def test_corrupt_checkpoint(tmp_path):
    ckpt = write(tmp_path / "broken.ckpt", "half a checkpoint")
    result = cli(f"hydra.run.dir={tmp_path}/run", *TINY, f"ckpt_path={ckpt}", cwd=tmp_path)
    assert_clean_failure(result, "is not a readable checkpoint", str(ckpt), code=2)
    assert ckpt.read_text() == "half a checkpoint"


def test_checkpoint_of_another_model(tmp_path):
    ckpt = tmp_path / "other.ckpt"
    torch.save(
        {
            "state_dict": {"policy.base_model.model.model.embed_tokens.weight": torch.zeros(3, 3)},
            "grpo_lightning": {"run_info": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}},
        },
        ckpt,
    )
    before = ckpt.read_bytes()
    result = cli(f"hydra.run.dir={tmp_path}/run", *TINY, f"ckpt_path={ckpt}", cwd=tmp_path)
    assert_clean_failure(result, "was written for model 'Qwen/Qwen2.5-0.5B-Instruct'", "model.lora", code=2)
    assert ckpt.read_bytes() == before
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained or written


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "words", "code"),
    [
        (["loss=foo"], "Could not find 'loss/foo'", 1),  # Hydra's own composition error
        (["generator.num_generations=1"], "generator.num_generations must be >= 2", 2),
        (["data.dataset.source=path", "data.dataset.path=/nope.jsonl"], "file not found: /nope.jsonl", 2),
    ],
    ids=["composition error", "config mistake", "input file missing"],
)
def test_real_cli_exit_codes(tmp_path, overrides, words, code):
    result = real_cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, words, code=code)


@pytest.mark.slow
def test_full_error_env_shows_the_traceback(tmp_path):
    env = dict(os.environ, HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_lightning",
            "dry_run=true",
            f"hydra.run.dir={tmp_path}/run",
            "generator.num_generations=1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode != 0 and "Traceback" in result.stderr
