"""A `pytest -n N` worker ends without the interpreter's teardown (tests/conftest.py, `pytest_unconfigure`): what it
reports and what its exit handlers do must survive that, a failure included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TESTS = """
import atexit, os

class FreedAtTeardown:  # the interpreter's teardown clears this module's globals, which calls this
    def __del__(self, _open=open, _path=os.environ["TEARDOWN_RAN"]):
        _open(_path, "w").write("ran")

KEPT = FreedAtTeardown()

def test_registers_an_exit_handler():
    atexit.register(lambda: open(os.environ["EXIT_HANDLER_RAN"], "w").write("ran"))

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "failed on purpose"
"""


def _one_worker(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-q", "test_sample.py"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_worker_reports_every_result_and_runs_the_exit_handlers(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    marker, teardown = tmp_path / "exit_handler_ran", tmp_path / "teardown_ran"
    env = dict(os.environ, PYTHONPATH=str(ROOT), EXIT_HANDLER_RAN=str(marker), TEARDOWN_RAN=str(teardown))
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_unconfigure  # noqa: F401\n")
    done = _one_worker(tmp_path, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout and "failed on purpose" in done.stdout
    assert marker.read_text() == "ran"  # run in the worker, which pytest_unconfigure ended...
    assert not teardown.exists()  # ...without the interpreter's teardown
    (tmp_path / "conftest.py").write_text("")  # the control: a worker that exits as the interpreter does
    done = _one_worker(tmp_path, env)
    assert "1 failed, 2 passed" in done.stdout and teardown.read_text() == "ran"


def test_exit_without_teardown_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path):
    code = (
        "import atexit, sys; from tests.conftest import exit_without_teardown; "
        f"atexit.register(lambda: open({str(tmp_path / 'ran')!r}, 'w').write('ran')); "
        "sys.stdout.write('buffered'); sys.stderr.write('also'); exit_without_teardown(3)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3
    assert done.stdout == "buffered" and done.stderr.endswith("also")  # written to pipes: block-buffered
    assert (tmp_path / "ran").read_text() == "ran"
