"""Every mistake a user can make at the command line ends in a short message, a non-zero exit, no traceback.

Each case asserts the exit code or error, the words that name the key or file (and what to do), that no
"Traceback" is printed, and that nothing already on disk was touched. `cli()` runs the CLI's own code in-process
(its argument checks, Hydra's compose, then `grpo_lightning.__main__.run`, which is what `main` calls) with the
output captured; `fails_in_process` calls `train(compose(...))` directly. Mistakes fail in validation, before
anything loads, so each takes well under a second. A few `slow` cases run the real `python -m grpo_lightning` in
a subprocess for what only a process shows: the exit code as a user sees it and HYDRA_FULL_ERROR.
"""

from __future__ import annotations

import contextlib
import gzip
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
from omegaconf.errors import OmegaConfBaseException

from grpo_lightning.__main__ import check_run_dir, describe
from grpo_lightning.__main__ import run as run_cli
from grpo_lightning.app.train import train
from grpo_lightning.moved_keys import check_moved_overrides
from tests.conftest import CONF_DIR, make_cfg
from tests.forked_cli import cli_run

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
    """`python -m grpo_lightning *args`, in-process: the CLI's own argument checks, Hydra's compose, then the
    CLI's error handling (`grpo_lightning.__main__.run`, what `main` calls), with the output captured.

    `hydra.run.dir=<dir>` becomes the run's output dir (unless `paths.output_dir` is given); a composition error
    exits 1 with Hydra's message, as the real CLI does. `real_cli` runs the real process.
    """
    overrides = [a for a in args if not a.startswith("hydra.run.dir=")]
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), str(cwd / "outputs"))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        problem = check_moved_overrides(list(args)) or check_run_dir(list(args))
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            code = 2
        else:
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
    """The real command in a process of its own, as a user runs it (forked past its imports: tests/forked_cli.py)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the user's default: no traceback
    env["PYTHONPATH"] = str(ROOT)
    return cli_run(*args, cwd=cwd, env=env)  # forked past its imports: tests/forked_cli.py


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
SELFPLAY = ["experiment=selfplay_tictactoe"]
CONFIG_MISTAKES = [
    ("unknown group option", ["loss=foo"], ["Could not find 'loss/foo'"]),
    ("unknown key", ["generator.num_generation=4"], ["generator.num_generation"]),
    ("missing required key", ["model=local"], ["model.source.path", "Missing mandatory value"]),
    ("wrong type (int)", ["variant.num_generations=four"], ["variant.num_generations must be an integer"]),
    ("wrong type (lr)", ["optim.optimizer.lr=fast"], ["optim.optimizer.lr must be a finite number", "'fast'"]),
    ("group size < 2", ["variant.num_generations=1"], ["variant.num_generations must be >= 2"]),
    ("pass@k samples without k", ["eval.num_samples=4"], ["eval.num_samples=4 samples completions", "eval.pass_k"]),
    ("game reward on gsm8k", ["reward=selfplay_role"], ["use data=games variant=selfplay"]),
    ("games played by grpo", ["data=games", "reward=selfplay"], ["variant=grpo", "add variant=selfplay"]),
    ("negative lr", ["optim.optimizer.lr=-0.1"], ["optim.optimizer.lr must be >= 0", "-0.1"]),
    ("max_new_tokens 0", ["generator.max_new_tokens=0"], ["generator.max_new_tokens must be >= 1"]),
    ("negative beta", ["loss.beta=-1"], ["loss.beta must be >= 0"]),
    ("zero prompts", ["data.prompts_per_round=0"], ["data.prompts_per_round must be >= 1"]),
    ("accumulation not dividing", ["trainer.accumulate_grad_batches=3"], ["trainer.accumulate_grad_batches"]),
    ("zero temperature", ["generator.temperature=0"], ["generator.temperature must be > 0"]),
    ("zero eval problems", ["eval.num_problems=0"], ["eval.num_problems must be >= 1"]),
    ("storpo min_steps 0", ["variant=storpo", "variant.min_steps=0"], ["variant.min_steps must be >= 1"]),
    ("storpo unknown rule", ["variant=storpo", "variant.step_rule=entropy"], ["variant.step_rule must be one of"]),
    ("storpo text fallback", ["variant=storpo", "variant.fallback_rule=line"], ["variant.fallback_rule must be one"]),
    ("storpo gap 0", ["variant=storpo", "variant.min_gap=0"], ["variant.min_gap must be >= 1"]),
    ("storpo gap text", ["variant=storpo", "variant.min_gap=two"], ["variant.min_gap must be an integer"]),
    ("storpo credit", ["variant=storpo", "variant.advantage=vine"], ["variant.advantage must be one of group, tree"]),
    ("game unknown", [*SELFPLAY, "data.dataset.game=chess"], ["data.dataset.game must be a built-in game", "chess"]),
    ("game not offline", [*SELFPLAY, "data.dataset.game=textarena:Wordle-v0"], ["data.dataset.game", "Wordle-v0"]),
    ("game group 1", [*SELFPLAY, "variant.games_per_group=1"], ["variant.games_per_group must be >= 2"]),
    ("game sampling", [*SELFPLAY, "variant.opponent_sampling=elo"], ["variant.opponent_sampling must be one of"]),
    ("game opponent", [*SELFPLAY, "variant.fixed_opponents=[random,gpt]"], ["variant.fixed_opponents", "'gpt'"]),
    ("game opponents text", [*SELFPLAY, "variant.fixed_opponents=random"], ["variant.fixed_opponents must be a list"]),
    ("game twice", [*SELFPLAY, "variant.fixed_opponents=[base,base]"], ["variant.fixed_opponents must not name"]),
    ("game eval opponent", [*SELFPLAY, "eval.opponents=[stockfish]"], ["eval.opponents", "'stockfish'"]),
    ("game max turns", [*SELFPLAY, "variant.max_turns=0"], ["variant.max_turns must be >= 1"]),
    ("game seeds overlap", [*SELFPLAY, "data.dataset.eval_seed=10"], ["data.dataset.eval_seed (10) must be >="]),
    ("unknown target", ["optim.optimizer._target_=torch.optim.Nope"], ["optim.optimizer._target_", "Nope"]),
    ("unknown argument", ["+optim.schedule.speed=2"], ["optim.schedule"]),
    ("missing model path", ["model=local", "model.source.path=/nope"], ["model.source.path is not a directory"]),
    (
        "probe on an incompatible setup",
        ["probe=[gns]", "data.groups_per_micro_batch=2"],
        ["probe=[gns] needs two batch sizes", "data.groups_per_micro_batch"],
    ),
    ("resume from a missing checkpoint", ["ckpt_path=/nope/last.ckpt"], ["ckpt_path", "/nope/last.ckpt"]),
    ("resume=last in a fresh dir", ["ckpt_path=last"], ["ckpt_path=last: no checkpoint", "hydra.run.dir"]),
    ("data path missing", ["data.dataset.source=path"], ["data.dataset.path must be set"]),
    (
        "vLLM in the training process with several training processes",
        ["generator=vllm", "trainer=ddp", "trainer.devices=2", "generator.engine_process=false"],
        ["generator.engine_process=false", "several training processes", "trainer.devices"],
    ),
    (
        "staleness bound below a round's steps",
        ["rollout.max_staleness=1", "data.num_iterations=2"],
        ["rollout.max_staleness=1 is below the 2 optimizer steps a round takes"],
    ),
    ("negative staleness bound", ["rollout.max_staleness=-1"], ["rollout.max_staleness must be >= 0"]),
    (
        "overlap with vLLM",
        ["generator=vllm", "rollout.max_staleness=1", "generator.engine_process=false"],
        ["rollout.max_staleness=1 with generator=vllm needs generator.engine_process=true"],
    ),
    (
        "overlap with HF generate",
        ["perf=plain", "rollout.max_staleness=1"],
        ["rollout.max_staleness=1 needs perf.generate.custom_decode=true"],
    ),
    ("moved lever", ["forward.share_prefix=false"], ["forward.share_prefix has moved: use perf.forward.share_prefix"]),
    (
        "moved generator lever",
        ["generator.custom_decode=false"],
        ["generator.custom_decode has moved: use perf.generate.custom_decode"],
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
        "eval.enabled=false",
        cwd=tmp_path,
    )
    assert_clean_failure(result, words, str(data), code=2)


def test_data_file_not_found(tmp_path):
    result = cli(
        "dry_run=true",
        f"hydra.run.dir={tmp_path}/run",
        "data.dataset.source=path",
        "data.dataset.path=/nope.jsonl",
        "eval.enabled=false",
        cwd=tmp_path,
    )
    assert_clean_failure(result, "data.dataset.path: file not found: /nope.jsonl", code=2)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_named_pipe_as_data_is_refused_without_waiting_for_a_writer(tmp_path, suffix):
    pipe = tmp_path / f"data{suffix}"
    os.mkfifo(pipe)
    args = ["dry_run=true", f"hydra.run.dir={tmp_path}/run", "data.dataset.source=path", f"data.dataset.path={pipe}"]
    result = cli(*args, "eval.enabled=false", cwd=tmp_path)  # reading the pipe would block: the test would hang
    assert_clean_failure(result, f"data.dataset.path: {pipe} is not a regular file", code=2)


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
        (["variant.num_generations=1"], "variant.num_generations must be >= 2", 2),
        (
            ["data.dataset.source=path", "data.dataset.path=/nope.jsonl", "eval.enabled=false"],
            "file not found: /nope.jsonl",
            2,
        ),
        (["reward.format_bonus=0.2"], "reward.terms.gsm8k.format_bonus", 2),  # a moved key, before Hydra sees it
    ],
    ids=["composition error", "config mistake", "input file missing", "moved key"],
)
def test_real_cli_exit_codes(tmp_path, overrides, words, code):
    result = real_cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, words, code=code)


@pytest.mark.slow
def test_full_error_env_shows_the_traceback(tmp_path):
    env = dict(os.environ, HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    result = cli_run(
        "dry_run=true", f"hydra.run.dir={tmp_path}/run", "variant.num_generations=1", cwd=tmp_path, env=env
    )
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.parametrize(
    ("override", "new_key"),
    [
        ("reward.format_bonus=0.2", "reward.terms.gsm8k.format_bonus"),
        ("loss.scale_rewards=none", "reward.group_transforms.normalize.scale"),
        ("variant.scale_rewards=none", "reward.group_transforms.normalize.scale"),
        ("forward.share_prefix=false", "perf.forward.share_prefix"),
        ("generator.custom_decode=false", "perf.generate.custom_decode"),
        ("generator.num_generations=4", "variant.num_generations"),
    ],
)
def test_cli_names_the_new_key_of_an_old_override(tmp_path, override, new_key):
    """In-process through the CLI's own code (`test_real_cli_exit_codes` runs one moved key as a real process)."""
    result = cli(override, "dry_run=true", f"paths.output_dir={tmp_path}", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {override.split('=')[0]} has moved: use {new_key} ")


# ---- in-process: train(compose(...)), failing before anything loads -----------------------------------------------
def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes: what must be on disk, unchanged, after a failed start."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fails_in_process(tmp_path: Path, *overrides: str) -> str:
    """Compose as the CLI does, run `train`, and return the CLI's one-line message of the error it raises.

    Asserts: a config error (the CLI exits 2 for it), one line, nothing lost or changed under `tmp_path` (a
    precious file is planted there first), and no checkpoint, log or policy written in the run directory.
    """
    precious = tmp_path / "earlier_results.txt"
    precious.write_text("an earlier run's results")
    before = snapshot(tmp_path)
    with pytest.raises((ValueError, OmegaConfBaseException)) as info:
        train(make_cfg(tmp_path / "run", list(overrides)))
    message = describe(info.value)
    assert "\n" not in message and message, message
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "a file on disk was changed"
    assert not [k for k in after if k not in before and not k.startswith("run/.run.lock")], after.keys() - before
    return message


def latin1_file(path: Path) -> Path:
    path.write_bytes(json.dumps({"question": "Caf\u00e9?", "answer": "#### 1"}, ensure_ascii=False).encode("latin-1"))
    return path


def utf16_file(path: Path) -> Path:
    path.write_bytes(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}).encode("utf-16"))
    return path


def utf16_no_bom_file(path: Path) -> Path:
    path.write_bytes(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}).encode("utf-16-le"))
    return path


def binary_file(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 8)
    return path


def gzip_file(path: Path) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}).encode()))
    return path


VALIDATION_MISTAKES = [
    # (id, overrides, words the message must contain)
    ("lora r not a number", ["model.lora.r=abc"], ["model.lora.r must be an integer", "'abc'"]),
    ("lora alpha not a number", ["model.lora.alpha=abc"], ["model.lora.alpha must be a finite number"]),
    ("lora dropout not a number", ["model.lora.dropout=abc"], ["model.lora.dropout must be a finite number"]),
    ("lora dropout 1.5", ["model.lora.dropout=1.5"], ["model.lora.dropout must be < 1"]),
    ("lora target modules empty", ["model.lora.target_modules=[]"], ["model.lora.target_modules"]),
    ("prompts per round not a number", ["data.prompts_per_round=abc"], ["data.prompts_per_round must be an integer"]),
    ("warmup not a number", ["optim.schedule.warmup_steps=abc"], ["optim.schedule.warmup_steps must be an integer"]),
    ("schedule kind unknown", ["optim.schedule.kind=step"], ["optim.schedule.kind must be one of constant"]),
    ("min ratio above 1", ["optim.schedule.min_ratio=2"], ["optim.schedule.min_ratio must be <= 1"]),
    ("negative seed", ["seed=-1"], ["seed must be >= 0", "-1"]),
    ("seed not a number", ["seed=abc"], ["seed must be an integer"]),
    ("seed beyond 32 bits", ["seed=4294967296"], ["seed must be <= 4294967295"]),
    ("betas out of range", ["optim.optimizer.betas=[2,3]"], ["optim.optimizer.betas must be two numbers in [0, 1)"]),
    ("betas of one", ["optim.optimizer.betas=[0.9]"], ["optim.optimizer.betas"]),
    ("negative weight decay", ["optim.optimizer.weight_decay=-1"], ["optim.optimizer.weight_decay must be >= 0"]),
    ("infinite lr", ["optim.optimizer.lr=inf"], ["optim.optimizer.lr must be a finite number", "inf"]),
    ("samples every 0 rounds", ["logging.samples_every_n_rounds=0"], ["logging.samples_every_n_rounds must be >= 1"]),
    ("negative samples logged", ["logging.num_samples_logged=-1"], ["logging.num_samples_logged must be >= 0"]),
    ("temperature 1e-40", ["generator.temperature=1e-40"], ["generator.temperature=1e-40", "greedy"]),
    ("top_p 0", ["generator.top_p=0"], ["generator.top_p must be > 0"]),
    ("top_k not a number", ["generator.top_k=abc"], ["generator.top_k must be an integer"]),
    (
        "sampler unknown",
        ["perf.generate.sampler=gumbel"],
        ["perf.generate.sampler must be one of inverse_cdf, multinomial"],
    ),
    ("lever not a bool", ["perf.forward.share_prefix=maybe"], ["perf.forward.share_prefix must be true or false"]),
    ("packed weights unknown", ["perf.generate.packed_weights=yes"], ["perf.generate.packed_weights must be one of"]),
    ("generate batch 0", ["generator.batch_size=0"], ["generator.batch_size must be an integer >= 1 or auto"]),
    ("generate batch word", ["generator.batch_size=all"], ["generator.batch_size must be an integer >= 1 or auto"]),
    ("epsilon_low 1.5", ["loss.epsilon_low=1.5"], ["loss.epsilon_low must be < 1"]),
    ("loss type unknown", ["loss.loss_type=ppo"], ["loss.loss_type must be one of grpo"]),
    (
        "group normalisation unknown",
        ["reward.group_transforms.normalize.scale=rank"],
        ["reward.group_transforms.normalize", "rank"],
    ),
    ("format bonus 2", ["reward.terms.gsm8k.format_bonus=2"], ["reward.terms.gsm8k", "format_bonus must be in [0, 1)"]),
    ("eval pass_k negative", ["eval.pass_k=-1"], ["eval.pass_k must be >= 0"]),
    ("eval enabled not a bool", ["eval.enabled=maybe"], ["eval.enabled must be true or false"]),
    ("split unknown", ["data.dataset.split=validation"], ["data.dataset.split must be one of train, test"]),
    (
        "template without question",
        ["data.dataset.prompt_template=Solve"],
        ["data.dataset.prompt_template must contain"],
    ),
    ("max epochs fractional", ["trainer.max_epochs=1.5"], ["trainer.max_epochs must be an integer"]),
    ("token budget 0", ["max_tokens_generated=0"], ["max_tokens_generated must be >= 1", "0"]),
    ("precision unknown", ["trainer.precision=8-mixed"], ["trainer.precision must be one of"]),
    ("devices 0", ["trainer.devices=0"], ["trainer.devices must be a count >= 1"]),
    ("accumulation 0", ["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches must be >= 1"]),
    ("checkpoint cadence not a number", ["checkpoint.every_n_rounds=often"], ["checkpoint.every_n_rounds must be an"]),
    ("last.ckpt every 0 rounds", ["checkpoint.last_every_n_rounds=0"], ["checkpoint.last_every_n_rounds must be >= 1"]),
    ("norm growth below 1", ["guard.max_norm_growth=0.5"], ["guard.max_norm_growth must be > 1"]),
    ("chunk 0", ["perf.forward.logits_chunk_tokens=0"], ["perf.forward.logits_chunk_tokens must be >= 1"]),
    ("model dtype unknown", ["model.dtype=float8"], ["model.dtype must be one of float32"]),
    (
        "storpo max below min",
        ["variant=storpo", "variant.min_steps=3", "variant.max_steps=2"],
        ["variant.max_steps (2)"],
    ),
    (
        "several mistakes at once",
        ["seed=abc", "model.lora.r=abc", "data.prompts_per_round=-2"],
        ["seed must be", "model.lora.r must be", "data.prompts_per_round must be >= 1"],
    ),
    # a key nothing takes, in any node and at the top level, named with the closest key that exists
    ("optimizer key", ["+optim.optimizer.momentum=0.9"], ["optim.optimizer.momentum is not a key", "betas, "]),
    ("LoRA key", ["+model.lora.rank=4"], ["model.lora.rank is not a key of model.lora", "target_modules"]),
    ("top-level typo", ["+max_token_generated=100"], ["did you mean max_tokens_generated?"]),
    ("variant typo", ["variant=storpo", "+variant.tress=3"], ["variant.tress", "did you mean variant.trees?"]),
    ("reward term key", ["+reward.terms.gsm8k.wieght=2"], ["did you mean reward.terms.gsm8k.weight?"]),
    ("games without self-play", [*SELFPLAY, "variant=grpo"], ["data=games is played by variant=selfplay"]),
    ("self-play without games", ["variant=selfplay"], ["variant=selfplay plays games: choose data=games"]),
    ("self-play on vllm", [*SELFPLAY, "generator=vllm"], ["generator=vllm cannot do yet", "generator=hf"]),
    ("self-play overlapped", [*SELFPLAY, "rollout.max_staleness=1"], ["set rollout.max_staleness=0"]),
    (
        "self-play perfect textarena",
        [*SELFPLAY, "data.dataset.game=textarena:Nim-v0", "variant.fixed_opponents=[perfect]"],
        ["variant.fixed_opponents: 'perfect' plays solved games only", "kuhn_poker", "tictactoe"],
    ),
    (
        "self-play random unlisted",
        [*SELFPLAY, "data.dataset.game=textarena:Othello-v0"],
        ["variant.fixed_opponents: 'random' plays a random legal move", "Othello-v0"],
    ),
    ("self-play full fine-tune", [*SELFPLAY, "model.lora.enabled=false"], ["LoRA snapshots", "model.lora.enabled"]),
    ("self-play gsm8k reward", [*SELFPLAY, "reward=reasoning_gym"], ["reward.terms.", "use reward=selfplay"]),
    (
        "self-play answer eval",
        [*SELFPLAY, "eval._target_=grpo_lightning.training.evaluation.Evaluator"],
        ["eval._target_ must be grpo_lightning.training.game_evaluation.GameEvaluator"],
    ),
    (
        "eval data path missing",
        ["data.dataset.source=path", "data.dataset.path=/dev/null"],
        ["eval.dataset.path must be set", "eval.enabled=false"],
    ),
]


@pytest.mark.parametrize(
    ("overrides", "words"), [c[1:] for c in VALIDATION_MISTAKES], ids=[c[0] for c in VALIDATION_MISTAKES]
)
def test_validation_mistake_in_process(tmp_path, overrides, words):
    message = fails_in_process(tmp_path, *overrides)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "make",
    [latin1_file, utf16_file, utf16_no_bom_file, binary_file, gzip_file],
    ids=["latin-1", "utf-16", "utf-16 without BOM", "binary", "gzip"],
)
@pytest.mark.parametrize("key", ["data.dataset.path", "eval.dataset.path"])
def test_data_file_in_another_encoding(tmp_path, make, key):
    bad = make(tmp_path / "bad.jsonl")
    good = write(tmp_path / "good.jsonl", json.dumps({"question": "What is 1+1?", "answer": "#### 2"}) + "\n")
    paths = {"data.dataset.path": good, "eval.dataset.path": good, key: bad}
    message = fails_in_process(tmp_path, "data.dataset.source=path", *(f"{k}={v}" for k, v in paths.items()))
    assert message.startswith(f"{key}: {bad}"), message
    assert any(word in message for word in ("UTF-8", "gzip", "binary")), message


def test_data_path_is_a_directory(tmp_path):
    message = fails_in_process(
        tmp_path, "data.dataset.source=path", f"data.dataset.path={tmp_path}", "eval.enabled=false"
    )
    assert message.startswith(f"data.dataset.path: {tmp_path} is a folder but not one written by save_to_disk")


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({}, ["has no config.json"]),
        ({"config.json": "{not json"}, ["config.json is not valid JSON"]),
        ({"config.json": "[]"}, ["has no model_type"]),
        ({"config.json": '{"model_type": "llama"}'}, ["holds no weights", "save_pretrained"]),
    ],
    ids=["empty folder", "broken config.json", "config.json without model_type", "no weights"],
)
def test_local_model_folder_mistakes(tmp_path, files, words):
    folder = tmp_path / "model"
    folder.mkdir()
    for name, content in files.items():
        write(folder / name, content)
    message = fails_in_process(tmp_path, "model=local", f"model.source.path={folder}")
    assert message.startswith("model.source.path:") and str(folder) in message, message
    for word in words:
        assert word in message, message


def test_cache_dir_is_a_file(tmp_path):
    blocker = write(tmp_path / "cache_file", "not a directory")
    message = fails_in_process(tmp_path, f"paths.cache_dir={blocker}")
    assert message.startswith(f"paths.cache_dir: {blocker} is a file"), message


def test_cache_dir_cannot_be_created(tmp_path):
    message = fails_in_process(tmp_path, "paths.cache_dir=/proc/grpo_lightning_cache")  # not writable, even as root
    assert message.startswith("paths.cache_dir: cannot create /proc/grpo_lightning_cache"), message
    assert "GRPO_LIGHTNING_CACHE" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake is asking for a GPU where there is none")
@pytest.mark.parametrize("override", ["trainer=gpu", "trainer.accelerator=cuda"])
def test_gpu_trainer_without_a_gpu(tmp_path, override):
    message = fails_in_process(tmp_path, override)
    assert "trainer.accelerator" in message and "no CUDA GPU" in message and "trainer=cpu" in message


def test_hub_model_offline_and_not_cached_fails_at_once(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # empty cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: no network
    message = fails_in_process(tmp_path, "model=qwen0.5b", "model.dtype=float32")
    assert message.startswith("model.source.repo_id 'Qwen/Qwen2.5-0.5B-Instruct' is not in the Hugging Face cache")
    assert "no network" in message and "model=local" in message


def test_max_prompt_tokens_shorter_than_the_template(tmp_path):
    """Needs the tokenizer, so it fails right after the (tiny) model loads, before any round."""
    message = fails_in_process(tmp_path, *TINY, "data.max_prompt_tokens=5")
    assert message.startswith("data.max_prompt_tokens (5) leaves no room for the question"), message


def test_max_new_tokens_beyond_the_context(tmp_path):
    message = fails_in_process(tmp_path, *TINY, "generator.max_new_tokens=4000")
    assert message.startswith("generator.max_new_tokens (4000) + data.max_prompt_tokens (512) exceed"), message
    assert "2048" in message


# ---- the CLI's exit codes, no traceback (in-process; test_real_cli_exit_codes runs the real process) -------------
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.lora.r=abc"], ["model.lora.r must be an integer"]),
        (["optim.optimizer.betas=[2,3]", "seed=-1"], ["optim.optimizer.betas", "seed must be >= 0"]),
    ],
    ids=["lora r", "two mistakes"],
)
def test_cli_validation_mistake_exits_2(tmp_path, overrides, words):
    result = cli(f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, *words, code=2)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), result.stderr


def test_cli_unwritable_run_dir(tmp_path):
    result = cli("hydra.run.dir=/proc/grpo_lightning_run", *TINY, cwd=tmp_path)
    assert_clean_failure(result, "/proc/grpo_lightning_run", code=2)


def test_an_unknown_textarena_game_suggests_only_games_that_run(tmp_path):
    """Close names come from the games that run offline here, never from those refused (ScorableGames-v0)."""
    overrides = ["data=games", "variant=selfplay", "reward=selfplay", "data.dataset.game=textarena:NoSuchGame-v0"]
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, "data.dataset.game")
    assert "ScorableGames" not in result.stderr and "Scorable" not in result.stderr, result.stderr


def test_a_csv_named_parquet_names_the_key_and_the_file(tmp_path):
    fake = write(tmp_path / "train.parquet", "question,answer\nWhat is 1+1?,2\n")
    overrides = ["data.dataset.source=path", f"data.dataset.path={fake}", "eval.enabled=false"]
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, "data.dataset.path", str(fake), "is not a Parquet file")


def test_a_mistake_in_a_value_the_recipe_set_names_the_recipe(tmp_path):
    """learn_arith sets data.prompts_per_round=16; with 3 groups a micro-batch it does not divide, and the message
    says the value came from the recipe. A value typed on the command line gets no such note. (The real command:
    the note reads Hydra's record of the run's choices and overrides.)"""
    result = real_cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", "experiment=learn_arith",
                 "data.groups_per_micro_batch=3", cwd=tmp_path)  # fmt: skip
    assert_clean_failure(result, "data.prompts_per_round", "experiment=learn_arith")
    typed = real_cli("dry_run=true", f"hydra.run.dir={tmp_path}/run2", "experiment=learn_arith",
                "data.groups_per_micro_batch=3", "data.prompts_per_round=16", cwd=tmp_path)  # fmt: skip
    assert_clean_failure(typed, "data.prompts_per_round")
    assert "experiment=learn_arith" not in typed.stderr, typed.stderr


def test_a_value_typed_under_a_node_the_message_names_is_not_traced_to_the_recipe(tmp_path):
    """experiment=selfplay_kuhn sets reward.terms.payoff; typing reward.terms.payoff.discount=0 is the user's
    mistake: the message names the full key and no recipe (a value under a node, or a node above a key, counts as
    typed)."""
    from grpo_lightning.__main__ import _related

    assert _related("reward.terms.payoff", "reward.terms.payoff.discount")  # the node above the typed key
    assert _related("reward.terms.payoff.discount", "reward.terms.payoff")  # a key under a typed node
    assert not _related("reward.terms.payoff", "reward.terms.payoffs") and not _related("data.seed", "seed")
    result = real_cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", "experiment=selfplay_kuhn",
                      "reward.terms.payoff.discount=0", cwd=tmp_path)  # fmt: skip
    assert_clean_failure(result, "reward.terms.payoff.discount must be in (0, 1]")
    assert "experiment=selfplay_kuhn" not in result.stderr, result.stderr


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("other_run", ["finished", "running"])
def test_a_refused_run_leaves_the_other_runs_directory_as_it_was(tmp_path, other_run):
    """A fresh run pointed at another run's directory is refused before it writes anything there: that run's
    Hydra record (.hydra/), its log and its checkpoint keep every byte. A running run (its lock held, here by this
    test's process) is named as in use, with its pid."""
    from grpo_lightning.training.checkpointing import RunLock

    run = tmp_path / "run"
    for name, text in {
        ".hydra/config.yaml": "seed: 7\n",
        ".hydra/overrides.yaml": "- seed=7\n",
        "__main__.log": "[the other run's log]\n",
        "checkpoints/last.ckpt": "its checkpoint",
    }.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)  # fmt: skip
    lock = RunLock(run) if other_run == "running" else None
    before = _snapshot(run)
    result = real_cli(f"hydra.run.dir={run}", *TINY, cwd=tmp_path)
    words = [f"is in use by another run (pid {os.getpid()})"] if lock else ["already holds a run", "ckpt_path=last"]
    assert_clean_failure(result, *words, code=2)
    assert _snapshot(run) == before
    if lock is not None:
        lock.release()
