"""The memory estimate's view of a run (`RunShape`), read from the composed config's declared settings objects and
the variant's group, before anything loads (app/memory.py estimates from it).

Each key is read through the settings dataclass that declares it (`settings_of`), so a key the config leaves out
counts at its declared default, never at a second default written here. `growth` holds how far each size key is
above its declared default: where the plan refuses a run, it names the key that grew most among those that make
the largest term (a prompt limit of 10^8 tokens is named, not the group's size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from grpo_lightning.accel.settings import ForwardSettings, GenerationSettings
from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.app.machine import gpu_memory
from grpo_lightning.app.run_settings import ModelSettings, TrainerKeys
from grpo_lightning.data.datamodule import DataSettings
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.generation.hf_engine import CPU_AUTO_ROWS, HFSettings
from grpo_lightning.schema import schemas_of, settings_of, target_class
from grpo_lightning.training.evaluation import EvalSettings
from grpo_lightning.training.game_evaluation import GameEvalSettings
from grpo_lightning.training.overlap import RolloutSettings
from grpo_lightning.variants.base import GroupShape


@dataclass(frozen=True)
class RunShape:
    """The config facts the estimate reads (train.py builds it from the composed config)."""

    dtype: str
    """model.dtype."""
    lora: bool
    reference_copy: bool
    """Full fine-tuning with loss.beta > 0 keeps a frozen copy of the model."""
    mixed_precision: bool
    """trainer.precision is bf16-mixed / 16-mixed: activations in half precision."""
    prompt_tokens: int
    new_tokens: int
    group_size: int
    """The most rollouts one prompt's group holds (the variant's `GroupShape.rollouts`)."""
    groups_per_micro_batch: int
    rollouts_per_round: int
    share_prefix: bool
    logits_chunk_tokens: int | None
    engine: str
    """Where sampling takes memory (`Generator.memory_kind`): 'hf', 'vllm' or 'remote'."""
    hf_batch_rows: int = 16
    """Sequences per HF generate call at most: generator.batch_size, the group's G samples of one prompt (a call
    never splits a prompt's samples), or eval.batch_size's greedy rows, whichever is largest."""
    decode_rows: int = 16
    """generator.batch_size as the HF engine will use it (`auto` resolved by `decode_rows` / `fit_decode_rows`)."""
    decode_rows_auto: bool = False
    """generator.batch_size=auto: `fit_decode_rows` may shrink `decode_rows` to what the GPU holds."""
    eval_rows: int = 0
    """eval.batch_size's greedy rows per call (0: no evaluation)."""
    trainer_on_gpu: bool = False
    engine_separate: bool = False
    """vLLM on its own GPU (generator.device=cuda:N)."""
    engine_on_cpu: bool = False
    """vLLM's CPU build."""
    engine_dtype: str = "float32"
    sleep_mode: bool = False
    gpu_memory_utilization: float = 0.3
    kv_cache_gib: float | None = None
    engine_gpu_bytes: int | None = None
    """The engine GPU's total memory when a GPU is visible (vLLM takes gpu_memory_utilization of it)."""
    overlap: bool = False
    """rollout.max_staleness >= 1: the HF engine's copy samples beside training (docs/overlap.md)."""
    cuda_streams: int = 1
    """Streams of the trainer's process that run cuBLAS on its GPU: the default stream; with the HF engine, the
    CUDA-graph decode's warm-up and capture streams (perf.generate.cuda_graphs) and the overlapped sampler's own."""
    activation_checkpointing: bool = False
    """perf.forward.activation_checkpointing: each decoder layer keeps its input only and is recomputed."""
    merged_lora: bool = False
    """The HF engine samples a LoRA policy through merged copies of the targeted weights (perf.generate.merge_lora)."""
    group_key: str = "variant.num_generations"
    """The config keys that set the group's size (the variant's), named where the estimate asks to lower them."""
    samples_per_prefix: int = 1
    """The most sequences a generate call samples from one prefix (the variant's): the engine's fewest rows."""
    shared_prompt: bool = True
    """The group's rollouts continue one prompt, which `share_prefix` runs once (not a game's turns)."""
    growth: dict[str, float] = field(default_factory=dict)
    """Size key -> its value over its declared default (keys absent: 1)."""

    def heaviest(self, *keys: str) -> str:
        """Of the keys that make one term, the one furthest above its default (the first on a tie)."""
        return max(keys, key=lambda k: self.growth.get(k, 1.0))


def decode_rows(batch_size: int | str, trainer_on_gpu: bool, round_rows: int) -> int:
    """Sequences per HF generate call before any fitting: `generator.batch_size` when a number, never above the
    rank's round (a call takes at most the rows it is given); `auto`: 16 on a CPU (`CPU_AUTO_ROWS`, the rows the
    CPU rounds were measured with, benchmarks/README.md), the rank's whole round on a GPU (`fit_decode_rows`
    shrinks it to what fits)."""
    if batch_size != "auto":
        return min(int(batch_size), round_rows)
    return round_rows if trainer_on_gpu else CPU_AUTO_ROWS


def eval_rows(cfg: DictConfig, world: int) -> int:
    """The most rows one evaluation call decodes: `eval.batch_size`, never above what a rank evaluates at once
    (its share of `eval.num_problems`, times the samples a problem gets: pass@k's, or a game's two seats against
    each opponent); 0 without evaluation."""
    settings = [settings_of(cfg.eval, schema) for schema in schemas_of(target_class(cfg.eval.get("_target_")))]
    shared = next((s for s in settings if isinstance(s, EvalSettings)), None)
    if shared is None or not shared.enabled:
        return 0
    games = next((s for s in settings if isinstance(s, GameEvalSettings)), None)
    per_problem = 2 * len(games.opponents) if games is not None else max(1, shared.num_samples * (shared.pass_k > 0))
    return min(shared.batch_size, math.ceil(shared.num_problems / world) * per_problem)


def run_shape(cfg: DictConfig, group: GroupShape, rollouts_per_round: int) -> RunShape:
    """The estimate's view of a composed, validated config and of the variant's group. With
    `generator.batch_size=auto` the decode rows are `decode_rows`' (plan.py fits them to the GPU)."""
    from grpo_lightning.generation.placement import shards_weights, trainer_devices, world_size

    model, trainer = settings_of(cfg.model, ModelSettings), settings_of(cfg.trainer, TrainerKeys)
    data, sampling = settings_of(cfg.data, DataSettings), settings_of(cfg.generator, SamplingConfig)
    forward = settings_of(cfg.perf.forward, ForwardSettings)
    engine = target_class(cfg.generator.get("_target_"))
    kind = engine.memory_kind if engine is not None else "hf"
    trainer_on_gpu = bool(trainer_devices(cfg)) or trainer.accelerator in ("gpu", "cuda")
    world = world_size(cfg)
    round_rows = math.ceil(rollouts_per_round / world)  # this rank's share of the round
    batch_size = settings_of(cfg.generator, HFSettings).batch_size if kind == "hf" else "auto"
    rows, evaluated = decode_rows(batch_size, trainer_on_gpu, round_rows), eval_rows(cfg, world)
    shape = dict(
        dtype=model.dtype,
        lora=model.lora.enabled,
        reference_copy=not model.lora.enabled and settings_of(cfg.loss, GRPOLoss).beta > 0,
        mixed_precision=str(trainer.precision) in ("bf16-mixed", "16-mixed", "16"),
        prompt_tokens=data.max_prompt_tokens,
        new_tokens=sampling.max_new_tokens,
        group_size=group.rollouts,
        group_key=" or ".join(group.keys),
        samples_per_prefix=group.samples_per_prefix,
        shared_prompt=group.shared_prompt,
        groups_per_micro_batch=data.groups_per_micro_batch,
        rollouts_per_round=rollouts_per_round,
        share_prefix=forward.share_prefix and not shards_weights(cfg.trainer),  # trainer=fsdp: one backbone call
        logits_chunk_tokens=forward.logits_chunk_tokens,
        activation_checkpointing=forward.activation_checkpointing,
        engine=kind,
        hf_batch_rows=max(rows, group.samples_per_prefix, evaluated),
        decode_rows=rows,
        decode_rows_auto=batch_size == "auto",
        eval_rows=evaluated,
        trainer_on_gpu=trainer_on_gpu,
        overlap=settings_of(cfg.get("rollout", {}), RolloutSettings).max_staleness > 0,
        growth=_growth(data, sampling, rows, evaluated),
    )
    if kind == "hf":  # the default stream, then the graphs' two and the overlapped sampler's
        generate = settings_of(cfg.perf.generate, GenerationSettings)
        shape["cuda_streams"] = 1 + 2 * generate.cuda_graphs + shape["overlap"]
        shape["merged_lora"] = generate.merge_lora
    if kind == "vllm":
        shape |= _vllm_shape(cfg, model.dtype)
    return RunShape(**shape)


def _growth(data: DataSettings, sampling: SamplingConfig, rows: int, evaluated: int) -> dict[str, float]:
    """Each size key's value over its declared default (`HFSettings.batch_size` counts as `CPU_AUTO_ROWS`)."""
    data_default, sampling_default, eval_default = DataSettings(), SamplingConfig(), EvalSettings()
    return {
        "data.max_prompt_tokens": data.max_prompt_tokens / data_default.max_prompt_tokens,
        "data.prompts_per_round": data.prompts_per_round / data_default.prompts_per_round,
        "data.groups_per_micro_batch": data.groups_per_micro_batch / data_default.groups_per_micro_batch,
        "generator.max_new_tokens": sampling.max_new_tokens / sampling_default.max_new_tokens,
        "generator.batch_size": rows / CPU_AUTO_ROWS,
        "eval.batch_size": evaluated / eval_default.batch_size,
    }


def _vllm_shape(cfg: DictConfig, model_dtype: str) -> dict:
    """The vLLM engine's part of the shape: where it runs and how much it takes."""
    from grpo_lightning.generation.vllm.engine_io import installed_platform
    from grpo_lightning.generation.vllm.settings import VLLMSettings, engine_dtype

    settings = settings_of(cfg.generator, VLLMSettings)
    on_cpu = installed_platform() == "cpu"
    return dict(
        engine_separate=settings.device not in (None, "cpu") and not on_cpu,
        engine_on_cpu=on_cpu,
        engine_dtype=engine_dtype(settings, model_dtype),
        sleep_mode=settings.sleep_mode and not on_cpu,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_gib=settings.kv_cache_gib,
        engine_gpu_bytes=None if on_cpu else gpu_memory(),
    )
