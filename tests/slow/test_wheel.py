"""The package as a user installs it: a built wheel, in a fresh venv, run from a directory with no source tree.

The wheel is built from a copy of the sources (no build files land in the checkout) and installed with
`--no-deps` into a new venv whose only other packages are this test environment's (a `.pth` line adds its
site-packages, so torch and friends are not downloaded again). What is under test is the wheel's own content:
the code and the data shipped inside it (the Hydra configs, the table of TextArena's games).
"""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_built_wheel_dry_runs_from_any_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "grpo_lightning", src / "grpo_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src)
    (wheel,) = dist.glob("grpo_lightning-*.whl")

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    (purelib / "test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    where = run(python, "-c", "import grpo_lightning; print(grpo_lightning.__file__)", cwd=work, env=env).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the installed wheel, not the checkout
    result = run(python, "-m", "grpo_lightning", "dry_run=true", cwd=work, env=env)
    assert "grpo_lightning plan (dry run)" in result.stdout
    assert "reference solutions score 1.0000" in result.stdout
    assert list(work.iterdir()) == []  # a dry run writes nothing
    configs = run(python, "-m", "grpo_lightning", "--cfg", "job", "loss=dapo", "variant=storpo", cwd=work, env=env)
    assert "loss_type: dapo" in configs.stdout and "completions_per_step" in configs.stdout
    table = "from grpo_lightning.games.textarena_games import OFFLINE_TWO_PLAYER as T; print('Nim-v0' in T)"
    assert run(python, "-c", table, cwd=work, env=env).stdout.strip() == "True"
