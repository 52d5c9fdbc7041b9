"""The calls the vLLM generator makes of its engine, answered in the training process or in a process of its own.

`VLLMGenerator` (generator.py) decides what to sample and which weights to push; the engine objects here hold the
`vllm.LLM` and make the calls:

- `LocalEngine`: the engine in the training process (`generator.engine_process: false`, the default for
  sequential rounds). A push hands the policy's tensors to the engine directly.
- `EngineProcess`: the same calls answered by a `LocalEngine` in a spawned child process
  (`generator.engine_process: true`, the default when rounds overlap, `rollout.max_staleness` >= 1). The engine
  then samples beside the trainer on cores (or a GPU) of its own: vLLM's CPU build replaces
  `torch.set_num_threads` by a no-op for its whole process and its Python scheduler would hold the trainer's GIL,
  so sharing one process cannot split a CPU between the two sides. None of the engine's process-wide effects
  (docs/vllm.md) reach the trainer either. Requests, results and weights go through a pipe; weights travel as
  CPU tensors in shared memory (torch.multiprocessing), so a push costs one copy of the pushed tensors.

Both draw the engine's random numbers from the global RNG of the process that holds it: the training process's
(seeded per rank by the rollout loop) in the first case, the child's, seeded with each round's seed by `reseed`,
in the second.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import random
import sys
import threading
import traceback
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from grpo_lightning.generation.vllm.engine_io import (
    environment,
    import_vllm,
    is_memory_error,
    launcher_env,
    parse_outputs,
    process_state_kept,
)
from grpo_lightning.generation.vllm.settings import CPU_KV_CACHE_GIB, VLLMSettings
from grpo_lightning.generation.vllm.weights import chunked, repack_tied_weights
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

PUSH_CHUNK_BYTES = 512 * 2**20
STARTUP_POLL_S = 1.0
"""How often a caller waiting on the engine process checks that it is still alive."""
_set_num_threads = torch.set_num_threads
"""torch's own setter, kept before vLLM's CPU worker replaces `torch.set_num_threads` by a no-op (engine process)."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything that builds and drives one engine; picklable, so a child process builds its engine from it."""

    kwargs: dict[str, Any]
    """The `vllm.LLM` arguments (engine_io.engine_kwargs)."""
    settings: VLLMSettings
    platform: str
    """'cuda' or 'cpu' (vLLM's CPU build)."""
    device_index: int
    """The engine's CUDA device (0 on the CPU)."""
    real_gpu: bool
    """Whether engine calls run under `torch.cuda.device(device_index)` (False on the CPU and with a fake backend)."""


@dataclass(frozen=True)
class CompletionRequest:
    """One `generate` call as the engine takes it, picklable: token-id prompts, each prompt's `SamplingParams`
    arguments (engine_io.sampling_kwargs; prompts with the same budget share one dict), what the answers are parsed
    with, and the adapter to sample with, (name, id, folder), with `generator.lora_sync=adapter`."""

    prompts: list[dict[str, list[int]]]
    params: list[dict[str, Any]]
    num_samples: int
    budgets: list[int]
    eos_token_ids: tuple[int, ...]
    lora: tuple[str, int, str] | None = None


class LocalEngine:
    """A `vllm.LLM` in this process; `backend` is `import_vllm()`'s namespace (the contract tests pass a fake)."""

    def __init__(self, spec: EngineSpec, backend) -> None:
        self.spec = spec
        self.backend = backend
        self.llm = self._build()

    def _build(self):
        spec = self.spec
        try:
            with launcher_env(spec.device_index), self._on_device(), self._eager(), process_state_kept():
                return self.backend.LLM(**spec.kwargs)
        except (ValueError, RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_memory_error(err):
                raise
            s = spec.settings
            if spec.platform == "cpu":
                raise ValueError(
                    f"the vLLM engine does not fit with generator.kv_cache_gib={s.kv_cache_gib} (null: "
                    f"{CPU_KV_CACHE_GIB} GiB on CPU) and generator.max_model_len={s.max_model_len}: raise "
                    "kv_cache_gib (it must hold one max_model_len sequence), lower max_model_len, or free memory. "
                    f"vLLM said: {err}"
                ) from err
            raise ValueError(
                f"the vLLM engine does not fit on cuda:{spec.device_index} with generator.gpu_memory_utilization"
                f"={s.gpu_memory_utilization} and generator.max_model_len={s.max_model_len}: lower the share if "
                "other memory is in use, raise it for a larger model or KV cache, lower max_model_len, or give "
                f"the engine its own GPU (generator.device). vLLM said: {err}"
            ) from err

    # ---- the calls ---------------------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return self._call(lambda: self.llm.apply_model(_parameter_names))[0]

    def complete(self, request: CompletionRequest) -> list[list[Completion]]:
        """The request's completions, result[i][j] sample j of prefix i (engine_io.parse_outputs)."""
        by_id: dict[int, Any] = {}  # one SamplingParams per distinct kwargs object (build_requests shares them)
        for kwargs in request.params:
            if id(kwargs) not in by_id:
                by_id[id(kwargs)] = self.backend.SamplingParams(**kwargs)
        params = [by_id[id(kwargs)] for kwargs in request.params]
        lora_request = self.backend.LoRARequest(*request.lora) if request.lora is not None else None
        prompts = request.prompts
        outputs = self._call(lambda: self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request))
        return parse_outputs(outputs, request.num_samples, request.budgets, request.eos_token_ids)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write (checkpoint name, tensor) pairs into the engine's model, in place.

        CUDA: the model's own `load_weights` in chunks of PUSH_CHUNK_BYTES (merged LoRA tensors are new
        allocations; chunks bound the extra GPU memory). CPU: vLLM's CPU build repacks every linear weight for
        its GEMM kernels after loading (oneDNN / sgl handlers) and leaves an empty parameter behind, so
        `load_weights` has nothing to write into; the worker's `reload_weights` restores each layer, loads it
        and repacks it (vLLM's layerwise reload). A layer is repacked once all its parameters have arrived,
        which is why CPU pushes are always full pushes; the iterator is consumed lazily, one tensor at a time.
        """
        if self.spec.platform == "cpu":
            kwargs = {"weights_iterator": weights, "is_checkpoint_format": True}
            self._call(lambda: self.llm.collective_rpc("reload_weights", kwargs=kwargs))
            self._call(lambda: self.llm.apply_model(repack_tied_weights))
            return
        for chunk in chunked(weights, PUSH_CHUNK_BYTES):
            self._call(lambda chunk=chunk: self.llm.apply_model(partial(_load_weights, weights=chunk)))

    def reset_prefix_cache(self) -> None:
        self._call(self.llm.reset_prefix_cache)

    def sleep(self, level: int) -> None:
        self._call(lambda: self.llm.sleep(level=level))

    def wake_up(self, tags: Sequence[str]) -> None:
        if self.spec.real_gpu:
            torch.cuda.empty_cache()  # the trainer's cached blocks would otherwise count against the engine
        self._call(lambda: self.llm.wake_up(tags=list(tags)))

    def reseed(self, round_seed: int) -> None:
        """No-op: in the training process the engine draws from the process's RNG, which the rollout loop seeds."""

    def close(self) -> None:
        """Nothing to stop: the engine lives as long as this process."""

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _on_device(self):
        return torch.cuda.device(self.spec.device_index) if self.spec.real_gpu else contextlib.nullcontext()

    def _eager(self):
        """On vLLM's CPU build with `enforce_eager` (this application's default there, engine_io.engine_kwargs),
        torch.compile directives are ignored during engine calls (`torch.compiler.set_stance("force_eager")`).

        `enforce_eager` keeps the model out of torch.compile, but vLLM compiles a few helper ops by decorator all
        the same, with inductor on the CPU: the sampler's rank count (`batched_count_greater_than`) at the first
        request for log-probs, which every round makes. That compile took 2.2-4.4 s of an engine's first
        `generate` on a 2-core AMD EPYC Zen 4 (AVX-512) and calls the C++ compiler; later calls took 0.18-0.22 s
        either way (the tests' 2-layer Llama). Its reason on a GPU (no [tokens, vocab] bool copy of the
        log-probs) is a few MB here. GPU engines keep vLLM's behaviour."""
        if self.spec.platform == "cpu" and self.spec.kwargs.get("enforce_eager"):
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def _call(self, fn):
        """Run an engine call with the engine's GPU current (separate mode: never the trainer's), and on the CPU
        build eagerly (`_eager`)."""
        with torch.no_grad(), self._on_device(), self._eager():
            return fn()


class EngineProcess:
    """A `LocalEngine` in a spawned child process, with the same calls (docs/vllm.md, "The engine in a process of
    its own").

    `threads`: the child's CPU threads (its OpenMP pool), set before vLLM is imported there; `set_threads` changes
    them later (torch's own setter, which vLLM's CPU worker hides behind a no-op). One call at a time (a lock);
    a call waits for its answer, so tensors it sent stay alive until the child has used them. The child ends when
    this object is collected, at exit, on `close()`, or when the training process dies (its end of the pipe
    closes).
    """

    def __init__(self, spec: EngineSpec, backend=None, threads: int | None = None) -> None:
        ctx = torch.multiprocessing.get_context("spawn")  # registers the shared-memory tensor reductions
        self._conn, child_conn = ctx.Pipe()
        self._lock = threading.Lock()
        with environment({"OMP_NUM_THREADS": str(threads)} if threads else {}):  # read once, at the child's start
            self._process = ctx.Process(
                target=_engine_main, args=(child_conn, spec, backend, threads), name="vllm-engine", daemon=False
            )
            self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._process)
        with self._lock:
            self._answer()  # the engine built, or its build error raised here

    # ---- the calls ---------------------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return self._request("parameter_names")

    def complete(self, request: CompletionRequest) -> list[list[Completion]]:
        return self._request("complete", request)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """CPU copies of the tensors go to the child in shared memory (never the policy's own storage: moving it
        to shared memory would change the trainer's parameters under it)."""
        self._request("load", [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights])

    def reset_prefix_cache(self) -> None:
        self._request("reset_prefix_cache")

    def sleep(self, level: int) -> None:
        self._request("sleep", level)

    def wake_up(self, tags: Sequence[str]) -> None:
        self._request("wake_up", list(tags))

    def reseed(self, round_seed: int) -> None:
        """Seed the child's RNGs, which only its engine draws from: a round's samples depend on its seed alone."""
        self._request("reseed", round_seed)

    def set_threads(self, threads: int) -> None:
        self._request("set_threads", threads)

    def close(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    # ---- the pipe ----------------------------------------------------------------------------------------------
    def _request(self, method: str, *args):
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("the vLLM engine process was closed")
            try:
                self._conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise self._died() from None
            return self._answer()

    def _answer(self):
        while not self._conn.poll(STARTUP_POLL_S):
            if not self._process.is_alive():
                raise self._died()
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._died() from None
        if status == "error":
            raise value
        return value

    def _died(self) -> RuntimeError:
        self._process.join(5)
        return RuntimeError(
            f"the vLLM engine process (pid {self._process.pid}) exited with code {self._process.exitcode}; its own "
            "error, if it printed one, is above. A negative code is the signal that ended it (-9: killed, often "
            "for memory: lower generator.kv_cache_gib)"
        )


class _Served:
    """What the child process answers: the engine's calls, and the ones that only make sense in a process of the
    engine's own (its global RNG and its thread count)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    def reseed(self, round_seed: int) -> None:
        random.seed(round_seed)
        np.random.seed(round_seed % 2**32)
        torch.manual_seed(round_seed)

    def set_threads(self, threads: int) -> None:
        _set_num_threads(threads)

    def __call__(self, method: str, args: tuple):
        if method in ("reseed", "set_threads"):
            return getattr(self, method)(*args)
        if method not in ("parameter_names", "complete", "load", "reset_prefix_cache", "sleep", "wake_up"):
            raise ValueError(f"the vLLM engine process has no call {method!r}")
        return getattr(self.engine, method)(*args)


def _engine_main(conn, spec: EngineSpec, backend, threads: int | None) -> None:
    """The child process: serve (`_serve`), then end without the interpreter's teardown.

    A spawned child otherwise ends in `sys.exit`, whose finalization frees every module torch and vLLM loaded:
    2-3 s on a 2-core AMD EPYC Zen 4, which the training process waits for at its end (`_stop`), and every run
    pays. What that exit runs for a purpose runs here: the exit handlers (vLLM's engine shutdown is one, through
    its `weakref.finalize`; multiprocessing's and logging's are others), then the standard streams are flushed.
    `atexit._run_exitfuncs` is the interpreter's own call for that step (CPython has no public one). An error
    escaping `_serve` takes the ordinary exit instead, traceback and all."""
    _serve(conn, spec, backend, threads)
    conn.close()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _serve(conn, spec: EngineSpec, backend, threads: int | None) -> None:
    """Build the engine, then answer calls until told to stop or the parent is gone."""
    if threads:
        _set_num_threads(threads)
    try:
        served = _Served(LocalEngine(spec, import_vllm() if backend is None else backend))
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        _send_error(conn, err)
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, ConnectionResetError, OSError):  # the training process is gone
            return
        if message is None:
            return
        try:
            result = served(*message)
        except BaseException as err:  # noqa: BLE001 - the parent raises it
            _send_error(conn, err)
            continue
        del message  # the pushed tensors' shared memory, freed before the answer lets the parent send more
        conn.send(("ok", result))


def _send_error(conn, err: BaseException) -> None:
    """The exception itself when it pickles (ValueErrors keep their one line for the CLI), else its text."""
    try:
        pickle.dumps(err)
    except Exception:  # noqa: BLE001 - any exception that will not travel is sent as text
        err = RuntimeError(f"{type(err).__name__}: {err}\n{''.join(traceback.format_exception(err))}")
    err.__traceback__ = None
    conn.send(("error", err))


def _stop(conn, process) -> None:
    """Ask the child to stop; kill it when it does not within a few seconds."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, EOFError, OSError):
        conn.send(None)
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)
    conn.close()


def _load_weights(model: nn.Module, weights: list) -> None:
    model.load_weights(weights)


def _parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]
