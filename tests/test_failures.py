"""What a resume may change and refuse, the divergence guard, the run-directory lock, checkpoint names, mixed
precision on CPU, and an interrupted model conversion (docs/resuming.md).

In-process with the tiny random model (`train` / `build_run` on composed configs), except where a real signal or
the CLI's exit code is the point.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from grpo_lightning.app.train import build_run, train
from grpo_lightning.errors import TrainingStopped
from grpo_lightning.training.checkpointing import FIXED_ON_RESUME
from tests.conftest import TINY, make_cfg
from tests.test_bad_input import cli

ROOT = Path(__file__).resolve().parents[1]
FAST = ["eval.enabled=false", "data.prompts_per_round=2", "generator.max_new_tokens=8"]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


class LrLog(L.Callback):
    """The lr each optimizer step runs with."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


BASE = [*TINY, *FAST, "optim.schedule.warmup_steps=0"]


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory):
    """A 1-round run with lr 1e-3, trained once for this file's resume tests; its output directory."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(make_cfg(run_dir, [*BASE, "trainer.max_epochs=1"]))
    return run_dir


@pytest.fixture
def finished_run(finished_once, tmp_path):
    """A copy of that run's output directory (holding checkpoints/last.ckpt) for one test: a resume writes in it."""
    shutil.copytree(finished_once, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def resume_cfg(run_dir: Path, *overrides: str):
    """The same run, resumed in place, with overrides."""
    return make_cfg(run_dir, [*BASE, "trainer.max_epochs=1", "ckpt_path=last", *overrides])


# ---- resume: what may change ------------------------------------------------------------------------------------
def test_resume_applies_a_new_lr_and_max_epochs(finished_run):
    run = build_run(resume_cfg(finished_run, "optim.optimizer.lr=1e-5", "trainer.max_epochs=3"))
    lrs = LrLog()
    run.trainer.callbacks.append(lrs)
    metrics = run.fit()
    assert lrs.lrs == [1e-5, 1e-5]  # rounds 1 and 2, with the new lr (the checkpoint's param groups held 1e-3)
    assert metrics["train/lr"] == pytest.approx(1e-5)
    assert load(finished_run / "checkpoints" / "last.ckpt")["epoch"] == 2


def test_resume_applies_a_new_schedule(finished_run):
    run = build_run(
        resume_cfg(finished_run, "trainer.max_epochs=3", "optim.schedule.kind=linear", "optim.optimizer.lr=2e-3")
    )
    lrs = LrLog()
    run.trainer.callbacks.append(lrs)
    run.fit()
    # 3 steps in all, step 0 done before the resume: linear decay from 2e-3 over 3 steps at steps 1 and 2
    assert lrs.lrs == pytest.approx([2e-3 * 2 / 3, 2e-3 * 1 / 3])


# ---- resume: what it refuses --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["seed=1"], ["seed 0 -> 1"]),
        (["loss=dapo"], ["loss.loss_type 'grpo' -> 'dapo'", "loss.epsilon_high 0.2 -> 0.28"]),
        (["variant.num_generations=3"], ["variant.num_generations 8 -> 3"]),
        (["data.prompts_per_round=4"], ["data.prompts_per_round 2 -> 4"]),
        (["model.lora.r=4"], ["model.lora.r 8 -> 4"]),
        (["model.lora.target_modules=[q_proj]"], ["model.lora.target_modules"]),
        (["seed=2", "variant.num_generations=2"], ["seed 0 -> 2", "variant.num_generations 8 -> 2"]),
    ],
    ids=["seed", "loss", "G", "prompts_per_round", "lora r", "lora targets", "two at once"],
)
def test_resume_refuses_keys_that_may_not_change(finished_run, overrides, keys):
    ckpt = finished_run / "checkpoints" / "last.ckpt"
    before = ckpt.read_bytes()
    with pytest.raises(ValueError) as info:
        build_run(resume_cfg(finished_run, *overrides))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"ckpt_path: {ckpt} cannot be resumed"), message
    for key in keys:
        assert key in message, message
    assert ckpt.read_bytes() == before


def test_fixed_keys_are_the_documented_ones():
    doc = (ROOT / "docs" / "resuming.md").read_text()
    for key in FIXED_ON_RESUME:
        assert f"`{key}`" in doc, key


# ---- the divergence guard -----------------------------------------------------------------------------------------
class BlowUpLr(L.Callback):
    """From round `at` on, multiply the lr by `factor` (as a resume with a huge lr would)."""

    def __init__(self, at: int, factor: float) -> None:
        self.at, self.factor = at, factor

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.at:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= self.factor


class Snapshot(L.Callback):
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        named = pl_module.policy.named_parameters()
        self.params.append({f"policy.{n}": p.detach().clone() for n, p in named if p.requires_grad})


def test_divergence_keeps_the_checkpoint_from_before_it(tmp_path):
    overrides = [*BASE, "trainer.max_epochs=4", "checkpoint.every_n_rounds=1"]
    cfg = make_cfg(tmp_path / "run", overrides)
    run = build_run(cfg)
    snaps = Snapshot()
    run.trainer.callbacks.extend([BlowUpLr(at=1, factor=1e33), snaps])
    with pytest.raises(TrainingStopped) as info:
        run.fit()
    message = str(info.value)
    assert "diverged" in message and "optim.optimizer.lr" in message and "guard.max_norm_growth" in message
    checkpoints = Path(cfg.paths.output_dir) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "round000.ckpt"]  # round 1 not saved
    last = load(checkpoints / "last.ckpt")
    assert last["epoch"] == 0 and f"ckpt_path={checkpoints / 'last.ckpt'}" in message
    for name, value in last["state_dict"].items():
        assert torch.equal(value, snaps.params[0][name]) and torch.isfinite(value).all(), name
    assert not (Path(cfg.paths.output_dir) / "policy").exists()  # the blown-up policy is not saved either
    # and the resume the message proposes, with a sane lr, goes on from round 1 to the end
    train(make_cfg(tmp_path / "run", [*overrides, "ckpt_path=last", "optim.optimizer.lr=1e-4"]))
    assert load(checkpoints / "last.ckpt")["epoch"] == 3


@pytest.mark.parametrize("lr", ["1e30", "1e6"])
def test_a_huge_lr_stops_the_run_and_names_it(tiny_cfg, lr):
    """lr=1e30: step 0 is finite and throws the weights to ~1e29; lr=1e6 used to run to the end with weights in the
    millions, a zero gradient and exit 0."""
    cfg = tiny_cfg(*FAST, "trainer.max_epochs=3", f"optim.optimizer.lr={lr}")
    with pytest.raises(TrainingStopped) as info:
        train(cfg)
    message = str(info.value)
    assert f"optim.optimizer.lr={float(lr):g} is too large" in message, message
    assert "nothing was saved" in message and "first round" in message
    assert not list(Path(cfg.paths.output_dir).rglob("*.ckpt"))


def test_non_finite_stop_blames_a_low_temperature(tiny_cfg):
    from tests.test_guards import poison

    run = build_run(
        tiny_cfg(*FAST, "trainer.max_epochs=3", "generator.temperature=0.01", "guard.max_consecutive_skipped_steps=1")
    )
    poison(run, {0, 1, 2}, "loss")
    with pytest.raises(TrainingStopped, match=r"generator\.temperature=0\.01 is so low"):
        run.fit()


# ---- one run per directory ----------------------------------------------------------------------------------------
def test_a_second_run_in_the_same_directory_is_refused_while_the_first_lives(tiny_cfg):
    cfg = tiny_cfg(*FAST, "trainer.max_epochs=1")
    first = build_run(cfg)
    with pytest.raises(ValueError, match=r"paths.output_dir: .* is in use by another run \(pid \d+\)"):
        build_run(cfg)
    first.fit()  # the first run is unharmed and releases the directory when it ends
    with pytest.raises(ValueError, match="already holds a run"):
        build_run(cfg)


def test_default_run_directories_are_unique(tmp_path):
    """Two runs started in the same second get two directories: the default hydra.run.dir holds the pid."""
    code = (
        "import sys; from hydra import compose, initialize_config_dir; import grpo_lightning;"
        "from hydra.core.hydra_config import HydraConfig; from omegaconf import OmegaConf;"
        f"initialize_config_dir(config_dir={str(ROOT / 'grpo_lightning' / 'conf')!r}, version_base='1.3');"
        "cfg = compose('config', return_hydra_config=True);"
        "print(OmegaConf.select(cfg, 'hydra.run.dir'))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    dirs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
        for _ in range(2)
    ]
    assert dirs[0] != dirs[1] and dirs[0].startswith("outputs/"), dirs


# ---- checkpoint names ---------------------------------------------------------------------------------------------
def test_periodic_checkpoints_are_named_roundNNN_and_resumable_from_the_cli(tmp_path):
    """The CLI's own code in-process (`cli`): Hydra's override parser is what must accept the file's name."""
    run_dir = tmp_path / "run"
    overrides = ["model=tiny", "trainer.enable_progress_bar=false", *FAST, "checkpoint.every_n_rounds=1"]
    first = cli(f"hydra.run.dir={run_dir}", *overrides, "trainer.max_epochs=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.ckpt", "round000.ckpt", "round001.ckpt"]
    ckpt = run_dir / "checkpoints" / "round000.ckpt"
    resumed = cli(
        f"hydra.run.dir={tmp_path}/resumed", *overrides, "trainer.max_epochs=2", f"ckpt_path={ckpt}", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {ckpt}" in resumed.stdout + resumed.stderr


# ---- mixed precision on CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_on_cpu(tiny_cfg, precision):
    metrics = train(tiny_cfg(*FAST, "trainer.max_epochs=1", f"trainer.precision={precision}"))
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])


# ---- an interrupted first-run conversion --------------------------------------------------------------------------
CONVERSION = """
import os, signal, sys
from pathlib import Path
from grpo_lightning.models.sources import PackagedGGUFSource

class Fake:
    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"x" * 1000)
        if sys.argv[2] == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)

source = PackagedGGUFSource(cache_dir=sys.argv[1])
source._build_plain_model = lambda: (Fake(), Fake())
try:
    print(source.ensure_converted())
except BaseException as err:
    print(type(err).__name__, err)
    sys.exit(128 + getattr(err, "signum", 0))
"""


def convert(cache: Path, mode: str) -> subprocess.CompletedProcess:
    """A first-run conversion in its own process, with the model building faked (the save is real)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", CONVERSION, str(cache), mode], capture_output=True, text=True, env=env)


def test_sigterm_during_conversion_leaves_no_temporary_folder(tmp_path):
    result = convert(tmp_path, "sigterm")
    assert result.returncode == 128 + signal.SIGTERM, result.stdout + result.stderr[-2000:]
    assert "RunInterrupted" in result.stdout
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_killed_conversions_leftovers_are_removed_by_the_next(tmp_path):
    from grpo_lightning.models.sources import PackagedGGUFSource

    target = PackagedGGUFSource(cache_dir=str(tmp_path)).converted_dir()
    stale = target.with_name(f"{target.name}.tmp-999999")  # as a SIGKILL mid-save leaves it
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    result = convert(tmp_path, "normal")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert not stale.exists() and (target / "model.safetensors").is_file()
