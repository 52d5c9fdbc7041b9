"""`python -m grpo_lightning ...` for the tests, without paying its imports in every run.

A CLI run spends about 6 s importing torch, Lightning (which imports torchmetrics, transformers, torch._dynamo)
and the package before Hydra parses a flag (on a 2-core AMD EPYC Zen 4); the slow tier starts about a hundred
of them. Here one server process per test process imports what `python -m grpo_lightning` imports, once, and
forks a child for each run. The child becomes what the interpreter would have been: the run's standard streams
on fds 0-2, its working directory, its environment, `sys.path` as `python -m` builds it from them, fresh seeds
for `random` and NumPy, Python's own signal dispositions; it runs `grpo_lightning` as `__main__` (runpy, as
`-m` does), then exits as the interpreter does (non-daemon threads joined, atexit handlers run, an uncaught
exception's traceback and exit code 1, an uncaught Ctrl-C ending by SIGINT). The server freezes what its imports
made before it forks (`gc.freeze`, as Python's gc docs advise for fork without exec): a child's collections
neither scan those objects nor copy their pages (measured: tests/README.md). Tests hold a `ForkedRun`, which
answers like `subprocess.Popen` (pid, poll, wait, kill, send_signal, communicate, returncode): the signals a
test sends reach the real process.

What a fork cannot give, a real process does (`cli_popen` falls back to `subprocess.Popen`):
- an environment that differs from the server's in a key read while the modules are imported
  (`IMPORT_TIME_ENV`): torch reads OMP_NUM_THREADS when it loads OpenMP, Python its PYTHON* variables at start-up;
- a working directory or PYTHONPATH under which `grpo_lightning` would be another checkout than the server's.
One thing is shared by every child of a server: `str` hashing (the interpreter's hash seed). Runs whose result
could depend on it are checked against real processes with other seeds (tests/test_resume.py).

Inside a forked run, the DDP ranks Lightning starts (ranks 1.., `python -m grpo_lightning ...` through
`subprocess.Popen` in Lightning's script launcher) are forked from the same server, under the same conditions, so
a two-process run pays no imports either. Such ranks share rank 0's hash seed, where real ones would each draw
their own: a run whose env has `GRPO_LIGHTNING_TEST_FORKED_RANKS=0` starts them as real processes
(tests/test_ddp.py keeps one pair of runs so, so that an order of `str` hashing that differs between ranks stays
tested).

`GRPO_LIGHTNING_TEST_FORKED_CLI=0` turns the server off (every run a real process).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_TIME_ENV = (
    "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NPY_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "LD_",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "LIGHTNING_", "SYMPY_", "MPL", "TF_", "XDG_",
    "HOME", "TMPDIR", "LANG", "LC_", "RANK", "LOCAL_RANK", "SLURM_", "JSM_",
)  # fmt: skip
"""Prefixes of the environment keys read while the CLI's modules are imported (Python's PYTHON*, OpenMP's and
torch's thread and allocator settings, the Hugging Face cache paths and switches, locale): a run whose value of
one differs from its server's starts a real process. Every other key reaches the child before the run reads it.
PYTHONPATH is an exception (the child builds `sys.path` from it), as are the keys in `RUN_TIME_ENV`."""
REPLAYED_ENV = frozenset({"RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"})
"""Keys read at import whose effect a forked child derives again from its own environment (`_replay_imports`):
Lightning sets `rank_zero_only.rank` from them when it is imported (lightning.fabric.utilities.rank_zero), and a
DDP rank its launcher starts carries LOCAL_RANK."""
RUN_TIME_ENV = frozenset({"PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", *REPLAYED_ENV})
"""Keys under those prefixes read only at run time, or replayed (`REPLAYED_ENV`). torch writes the inductor cache
path and the NVML switch into os.environ as it runs (`torch._inductor.runtime.cache_dir_utils.cache_dir`,
`torch.cuda._nvml_based_avail` reads the other), so a test process that has trained in-process holds them, and
every run built from its environment carries them."""
ENABLED = os.environ.get("GRPO_LIGHTNING_TEST_FORKED_CLI", "1") != "0"
MAX_MESSAGE = 1 << 20


def _import_time_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in RUN_TIME_ENV))


def _same_checkout(env: dict[str, str], cwd: Path, ready: dict) -> bool:
    """Whether a `python -m grpo_lightning` process with this env and cwd would import the server's checkout of
    `grpo_lightning` (the first found on its path). With equal import-time settings (`_import_time_env`), such a
    process would have made the server's imports."""
    search = [cwd, *(Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    hit = next((p.resolve() for p in search if (p / "grpo_lightning" / "__init__.py").is_file()), None)
    return (str(hit) if hit is not None else ready["installed"]) == ready["loaded"]


# ---- the server (its own process) -------------------------------------------------------------------------------
def serve(address: str) -> None:
    """Import what the CLI imports, say `ready` on stdout, then fork a child per request until stdin closes."""
    env = dict(os.environ)  # before the imports, which may set keys of their own
    base = [p for p in sys.path if p not in ("", *os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    saved, sys.path[:] = sys.path[:], base
    import importlib.util

    installed = importlib.util.find_spec("grpo_lightning")  # what a process without ROOT on its path imports
    sys.path[:] = saved
    import grpo_lightning
    import grpo_lightning.__main__  # noqa: F401 - the CLI's imports, once; not run (its name is not __main__)

    del sys.modules["grpo_lightning.__main__"], grpo_lightning.__main__  # the child runs it afresh as __main__
    gc.collect()
    gc.freeze()  # what the imports made, out of every child's collections: they neither scan it nor copy its pages
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    ready = {
        "threads": threads,  # a fork copies only the calling thread: the client refuses a server with others
        "loaded": str(Path(grpo_lightning.__file__).resolve().parents[1]),
        "installed": str(Path(installed.origin).resolve().parents[1]) if installed and installed.origin else None,
        "env": env,  # what a run's import-time settings are compared with
        "address": address,
    }
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    running: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.01)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            # The test process is gone or done; running children go on, as real processes would. The server ends
            # without the interpreter's shutdown, which would free every module imported above (2-3 s that the
            # test process's exit waits for: `_Server.close`).
            _finalize()
            os._exit(0)
        if listener in readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, conn, *running.values()):
                    other.close()
                _become_the_run(json.loads(message), fds, base, ready)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the test dropped its handle
                    conn.send(json.dumps({"status": status}).encode())
                conn.close()


def _become_the_run(request: dict, fds: list[int], base: list[str], ready: dict) -> None:
    """In the forked child: set up what the interpreter would have, run the CLI, exit as the interpreter does."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _replay_imports()
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *pythonpath, *base]
        for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
            del sys.modules[name]  # the server's own module: a run imports tests.helpers afresh from its path
        encoding = sys.stdout.encoding
        sys.stdin = sys.__stdin__ = open(0, closefd=False, encoding=encoding)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False, encoding=encoding)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, encoding=encoding, errors="backslashreplace")  # noqa: SIM115
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # block-buffered into a pipe, as at start-up
        sys.stderr.reconfigure(line_buffering=True)
        import random

        random.seed()  # a fresh process seeds from the OS; a fork would repeat the server's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _fork_ddp_ranks(ready)
        sys.argv = ["-m", *request["args"]]  # runpy puts the module's path in argv[0], as -m does
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            _finalize()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # what the interpreter does with an uncaught Ctrl-C
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        _finalize()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _replay_imports() -> None:
    """What the server's imports derived from the keys in `REPLAYED_ENV`, derived again from this run's
    environment, by the expression Lightning runs at import."""
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0


class _RankLauncherSubprocess:
    """`subprocess` as Lightning's DDP script launcher sees it inside a forked run: its `Popen` of
    `[sys.executable, "-m", "grpo_lightning", ...]` (ranks 1.., streams inherited) becomes a `ForkedRun` from this
    run's server where that process would have made the server's imports; any other call is `subprocess`'s own."""

    def __init__(self, ready: dict) -> None:
        self.ready = ready

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def Popen(self, command, *, env=None, cwd=None, **kwargs):  # noqa: N802 - subprocess's name
        env = dict(os.environ if env is None else env)
        cwd = Path(os.getcwd() if cwd is None else cwd)
        forkable = (
            not kwargs
            and list(command[:2]) == [sys.executable, "-m"]
            and command[2] in ("grpo_lightning", "grpo_lightning.__main__")  # `__main__.__spec__.name`
            and env.get("GRPO_LIGHTNING_TEST_FORKED_RANKS", "1") != "0"
            and _import_time_env(env) == _import_time_env(self.ready["env"])
            and _same_checkout(env, cwd, self.ready)
        )
        if not forkable:
            return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
        return ForkedRun(
            self.ready["address"], list(command[3:]), cwd, env, text=False, capture=False, module=command[2]
        )


def _fork_ddp_ranks(ready: dict) -> None:
    """Lightning's script launcher (trainer=ddp on CPUs) starts ranks 1.. with `subprocess.Popen`: from here on,
    in this forked run, it forks them from the server (`_RankLauncherSubprocess`)."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script.subprocess = _RankLauncherSubprocess(ready)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finalize() -> None:
    """The interpreter's shutdown, in its order: wait for non-daemon threads, run atexit handlers, flush."""
    threading._shutdown()
    run_exit_handlers()


def run_exit_handlers() -> None:
    """The atexit handlers, then the standard streams flushed: what an exit runs for a purpose, before freeing
    the modules. `atexit._run_exitfuncs` is the interpreter's own call for that step (CPython has no public one)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


# ---- the test side ------------------------------------------------------------------------------------------
class _Server:
    """The server process (`serve`) and the socket it listens on, in a folder of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="grpo-forked-cli-")
        self.address = os.path.join(self.folder, "socket")
        code = f"from tests.forked_cli import serve; serve({self.address!r})"  # cwd ROOT: '' on sys.path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env
        )
        line = self.proc.stdout.readline()
        self.ready = json.loads(line) if line else None

    @property
    def usable(self) -> bool:
        return self.ready is not None and self.ready["threads"] == 1

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


BASE_ENV = dict(os.environ)
"""The environment a server gets: this process's when the tests were collected, before any test changed it."""
_servers: list[_Server] = []


def _server_for(env: dict[str, str], cwd: Path) -> _Server | None:
    """The server whose imports this run would have made itself, or None (then a real process)."""
    if not ENABLED or _import_time_env(env) != _import_time_env(BASE_ENV):  # the server's, less PYTHONPATH
        return None
    if not _servers:
        _servers.append(_Server(dict(BASE_ENV, PYTHONPATH=str(ROOT))))
    server = _servers[0]
    if not server.usable:
        return None
    return server if _same_checkout(env, cwd, server.ready) else None


@atexit.register
def close_servers() -> None:
    for server in _servers:
        server.close()
    _servers.clear()


class ForkedRun:
    """A CLI run forked from a server, answering as `subprocess.Popen` does for the calls tests make."""

    def __init__(
        self,
        address: str,
        args: list[str],
        cwd: Path,
        env: dict[str, str],
        text: bool,
        capture: bool = True,
        module: str = "grpo_lightning",
    ) -> None:
        """`capture`: stdout and stderr into pipes (`self.stdout`, `self.stderr`), as `stdout=PIPE, stderr=PIPE`;
        else the run writes to this process's own fds 1 and 2 and reads its fd 0, as a `Popen` without them."""
        self.args, self.text, self.returncode = args, text, None
        if capture:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            streams = [os.open(os.devnull, os.O_RDONLY), out_w, err_w]
        else:
            streams = [os.dup(fd) for fd in (0, 1, 2)]
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.conn.connect(address)
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env}
        socket.send_fds(self.conn, [json.dumps(request).encode()], streams)
        for fd in streams:
            os.close(fd)
        reply = self.conn.recv(MAX_MESSAGE)
        if not reply:
            raise RuntimeError("the forked-CLI server closed the connection before starting the run")
        self.pid = json.loads(reply)["pid"]
        self.stdout = open(out_r, "rb") if capture else None  # noqa: SIM115
        self.stderr = open(err_r, "rb") if capture else None  # noqa: SIM115

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self.conn], [], [], 0)
            if readable:
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            readable, _, _ = select.select([self.conn], [], [], timeout)
            if not readable:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        reply = self.conn.recv(MAX_MESSAGE)
        if not reply:
            raise RuntimeError(f"the forked-CLI server died while run {self.pid} was running")
        self.returncode = os.waitstatus_to_exitcode(json.loads(reply)["status"])
        self.conn.close()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str | bytes, str | bytes]:
        """Both streams to their ends, then the exit status: `Popen.communicate` without input."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = {s: [] for s in (self.stdout, self.stderr) if s is not None}
        open_streams = [s for s in chunks if not s.closed]
        while open_streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select(open_streams, [], [], left)
            if not readable:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for stream in readable:
                data = os.read(stream.fileno(), 1 << 16)
                if data:
                    chunks[stream].append(data)
                else:
                    stream.close()
                    open_streams.remove(stream)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not chunks:  # not captured: the run wrote to this process's own streams
            return None, None
        out, err = (b"".join(chunks[s]) for s in (self.stdout, self.stderr))
        return (_text(out), _text(err)) if self.text else (out, err)


def _text(data: bytes) -> str:
    """`Popen(text=True)`'s decoding: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=None).read()


def cli_popen(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, text: bool = True):
    """`subprocess.Popen([sys.executable, "-m", "grpo_lightning", *args], stdout=PIPE, stderr=PIPE, ...)`: a
    `ForkedRun` where a server can stand in for the interpreter's start-up, else that real process."""
    env = dict(os.environ if env is None else env)
    server = _server_for(env, Path(cwd))
    if server is not None:
        return ForkedRun(server.address, list(args), Path(cwd), env, text)
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_lightning", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=text,
    )


def cli_run(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", "grpo_lightning", *args], capture_output=True, text=True, ...)`."""
    proc = cli_popen(*args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess([sys.executable, "-m", "grpo_lightning", *args], proc.returncode, out, err)
