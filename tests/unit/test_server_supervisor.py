"""The supervisor between a run and a server it starts (generation/vllm/server_supervisor.py), with a stand-in server: a
Python process that forks a child of its own (as vLLM forks its engine) and sleeps. Truth: the process table.
The real server: tests/test_vllm_server_faults.py (vLLM tier)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_lightning.generation.vllm.server_process import ServerLaunch, ServerProcess
from tests.processes import group_members, parent_of, wait_gone

pytestmark = pytest.mark.slow  # starts processes

FORKING_SERVER = textwrap.dedent("""
    import subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its "engine"
    print("ready", flush=True)
    time.sleep(600)
""")


def launch(tmp_path) -> ServerLaunch:
    (tmp_path / "forking_server.py").write_text(FORKING_SERVER)
    return ServerLaunch("x", [], python=sys.executable, module="forking_server", env={"PYTHONPATH": str(tmp_path)})


def members_after_start(pgid: int) -> list[int]:
    deadline = time.monotonic() + 20
    while len(group_members(pgid)) < 3 and time.monotonic() < deadline:  # supervisor, server, engine
        time.sleep(0.1)
    return group_members(pgid)


def test_a_killed_server_leaves_no_engine_behind(tmp_path):
    server = ServerProcess(launch(tmp_path), tmp_path / "server.log")
    pgid = server.process.pid
    assert len(members_after_start(pgid)) == 3
    (api,) = [pid for pid in group_members(pgid) if parent_of(pid) == pgid]
    subprocess.run(["kill", "-9", str(api)], check=True)
    assert wait_gone(pgid, timeout_s=20) == []  # the engine, re-parented to init, stopped with the group
    assert server.process.wait(timeout=5) == 128 + signal.SIGKILL


def test_stop_ends_the_whole_group(tmp_path):
    server = ServerProcess(launch(tmp_path), tmp_path / "server.log")
    assert len(members_after_start(server.process.pid)) == 3
    server.stop()
    assert wait_gone(server.process.pid, timeout_s=5) == []


def test_a_run_killed_with_sigkill_leaves_no_server_behind(tmp_path):
    (tmp_path / "forking_server.py").write_text(FORKING_SERVER)
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from grpo_lightning.generation.vllm.server_process import ServerLaunch, ServerProcess
        launch = ServerLaunch("x", [], python=sys.executable, module="forking_server", env={{"PYTHONPATH": {str(tmp_path)!r}}})
        server = ServerProcess(launch, Path({str(tmp_path)!r}) / "server.log")
        print(server.process.pid, flush=True)
        time.sleep(600)
    """)  # noqa: E501
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(run.stdout.readline())
        assert len(members_after_start(pgid)) == 3
        run.send_signal(signal.SIGKILL)  # no atexit, no finalizer
        run.wait(timeout=10)
        assert wait_gone(pgid, timeout_s=20) == []
    finally:
        if run.poll() is None:
            run.kill()
