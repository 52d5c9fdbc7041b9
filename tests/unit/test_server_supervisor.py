"""The supervisor between a run and a server it starts (generation/vllm/server_supervisor.py), with a stand-in server: a
Python process that forks a child of its own (as vLLM forks its engine) and sleeps. Truth: the process table.
The real server: tests/test_vllm_server_faults.py (vLLM tier)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


def cores_of(pid: int) -> list[int]:
    from grpo_lightning.generation.vllm.server_supervisor import parse_cpu_list

    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return parse_cpu_list(next(line for line in status if line.startswith("Cpus_allowed_list:")).split()[1])


def test_a_server_given_cores_runs_there_with_its_forks_and_vllms_binding(tmp_path):
    """`ServerLaunch.cpus`: the server and the process it forks (vLLM's engine) may run on those cores only,
    whichever the run may use, and vLLM is told the same cores (`VLLM_CPU_OMP_THREADS_BIND`). Truth: the kernel's
    view of each process (/proc/<pid>/status, /proc/<pid>/environ)."""
    import dataclasses
    import os

    core = max(os.sched_getaffinity(0))
    server = ServerProcess(dataclasses.replace(launch(tmp_path), cpus=str(core)), tmp_path / "server.log")
    try:
        members = members_after_start(server.process.pid)
        assert len(members) == 3
        for pid in members:
            assert cores_of(pid) == [core]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"VLLM_CPU_OMP_THREADS_BIND={core}".encode() in environ
        assert cores_of(os.getpid()) == sorted(os.sched_getaffinity(0))  # the run keeps its own
    finally:
        server.stop()
    assert wait_gone(server.process.pid, timeout_s=5) == []


def test_cores_the_machine_lacks_stop_the_server_at_start_naming_them(tmp_path):
    import dataclasses

    server = ServerProcess(dataclasses.replace(launch(tmp_path), cpus="4096"), tmp_path / "server.log")
    assert server.process.wait(timeout=20) == 2
    assert "cannot run the server on cores 4096" in (tmp_path / "server.log").read_text()
