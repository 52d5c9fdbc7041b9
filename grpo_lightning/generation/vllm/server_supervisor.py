"""The process between a run and a `vllm serve` server it starts: the server stops whole, with its engine
processes, on every way the run or the server can end.

    python server_supervisor.py <run pid> [--cpus <CPU list>] <command...>

Run as a file (standard library only, no package import: it starts in milliseconds, in whatever environment the
server uses) as the leader of a process group of its own, which the server and every process vLLM forks
(`VLLM::EngineCore`, `VLLM::Worker`) join. It stops the whole group when:

- the run asks (SIGTERM or SIGINT to the supervisor, or to the group);
- the run is gone, however it ended, SIGKILL included: its pid is no longer the supervisor's parent (checked
  twice a second; Linux's parent-death signal is not used: it fires when the thread that started the process
  ends, not the run);
- the server exits, or is killed: the engine processes it leaves behind, re-parented to init, still belong to
  the group and are stopped with it.

With `--cpus` (Linux's CPU list format, "0-3,5"), the server and every process it forks run on those cores only
(the supervisor's affinity, set before it starts the server, is inherited), whatever cores the run was given.

Stopping is SIGTERM to the group, then SIGKILL to what is left after `GRACE_S`. The supervisor exits with the
server's exit code (128 + the signal for a server killed by a signal).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
"""How long the group gets between SIGTERM and SIGKILL."""
POLL_S = 0.5


def stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to every process of the group but this one, SIGKILL to what is left after GRACE_S."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's signal must not stop the supervisor half-way
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgrp(), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (server.poll() is None or _group_members()):
        time.sleep(0.1)
    for pid in _group_members():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=5)


def _group_members() -> list[int]:
    """The pids of this process group other than the supervisor (read from /proc: no tool needed)."""
    group, me, members = os.getpgrp(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != b"Z":  # fields after the name: state, ppid, pgrp
            members.append(int(entry))
    return members


def parse_cpu_list(spec: str) -> list[int]:
    """Linux's CPU list format, as `taskset -c` and vLLM's `VLLM_CPU_OMP_THREADS_BIND` take it: "0-3,5" ->
    [0, 1, 2, 3, 5]. ValueError on anything else (an empty list, a reversed range, a negative id)."""
    cpus: list[int] = []
    for part in str(spec).split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"{spec!r} is not a CPU list such as '0-3,5'")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def main(argv: list[str]) -> int:
    run_pid, command = int(argv[0]), argv[1:]
    if os.getppid() != run_pid:  # the run was gone before the supervisor started
        return 1
    if command[:1] == ["--cpus"]:
        cpus, command = command[1], command[2:]
        try:
            os.sched_setaffinity(0, parse_cpu_list(cpus))
        except (ValueError, OSError) as err:
            print(f"server_supervisor: cannot run the server on cores {cpus}: {err}", flush=True)
            return 2
    asked = []
    signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: asked.append(signum))
    server = subprocess.Popen(command)  # same process group: the server and its forks
    while server.poll() is None and not asked and os.getppid() == run_pid:
        time.sleep(POLL_S)
    stop_group(server)
    code = server.returncode
    if code is None:
        return 1
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
