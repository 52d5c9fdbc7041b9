"""The speed levers' switches, one frozen object per phase, built from the `perf` config group.

Defaults are the `cpu_fast` preset (grpo_lightning/conf/perf/cpu_fast.yaml); `plain()` is every lever off, the
reference path each lever is tested against (docs/performance.md); `perf=gpu` (what `trainer=gpu` selects) is the
GPU's choice (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpo_lightning.schema import boolean, check_settings, choice, integer, optional, setting

SAMPLERS = ("inverse_cdf", "multinomial")
DECODE_WEIGHTS = ("float32", "bfloat16", "int8")  # perf.generate.weights (low_precision.py)


def check_sampler(sampler: str) -> str:
    """The sampler's name, or a ValueError naming `perf.generate.sampler`."""
    if sampler not in SAMPLERS:
        raise ValueError(f"perf.generate.sampler must be one of {', '.join(SAMPLERS)} (got {sampler!r})")
    return sampler


def check_packed_weights(mode: bool | str) -> bool | str:
    """The mode, or a ValueError naming `perf.generate.packed_weights`."""
    if not (mode is True or mode is False or mode == "auto"):
        raise ValueError(f"perf.generate.packed_weights must be true, false or auto (got {mode!r})")
    return mode


def correction_dtype(weights: str) -> str:
    """The HF engine's dtype as the rollout correction's `auto` reads it (`loss.rollout_correction.engine_dtype`,
    through the `hf_decode_dtype` resolver): `auto` (the policy's own dtype) when `perf.generate.weights=float32`
    lets the policy sample as it is, else the lever's precision (int8 differs from every trainer dtype)."""
    return "auto" if weights == "float32" else str(weights)


@dataclass(frozen=True)
class ForwardSettings:
    """Training forward (`perf.forward`): how completion log-probs are computed (completion_forward.py)."""

    share_prefix: bool = setting(True, boolean)
    logits_chunk_tokens: int | None = setting(128, optional(integer(1)))
    runs_by_length: bool = setting(True, boolean)
    fused_lora: bool = setting(True, boolean)
    activation_checkpointing: bool = setting(False, boolean)

    def __post_init__(self) -> None:
        check_settings(self, "perf.forward")

    @staticmethod
    def joint_problems(values: dict, prefix: str) -> list[str]:
        """A checkpointed layer recomputes without a KV cache (transformers drops it under checkpointing), so the
        completions could not attend to a prompt that ran once for the group: the two levers exclude each other."""
        if values.get("activation_checkpointing") and values.get("share_prefix"):
            return [
                f"{prefix}.activation_checkpointing=true needs {prefix}.share_prefix=false: a checkpointed layer "
                "recomputes without the shared prompt's KV cache (perf=gpu sets both)"
            ]
        return []

    @classmethod
    def plain(cls) -> ForwardSettings:
        return cls(share_prefix=False, logits_chunk_tokens=None, runs_by_length=False, fused_lora=False)

    def one_backbone_call(self) -> ForwardSettings:
        """These levers with the backbone run once per forward over every row: without the runs by length and the
        shared prompts, whose number of backbone calls depends on the rows (their lengths, their prompts). A
        sharded policy (trainer=fsdp) needs it: each call gathers every decoder layer, a collective that every
        process must issue as often as the others."""
        return dataclasses.replace(self, share_prefix=False, runs_by_length=False)


@dataclass(frozen=True)
class GenerationSettings:
    """HF generation (`perf.generate`): how rollouts are sampled (generator=hf; the vLLM engine ignores these)."""

    custom_decode: bool = setting(True, boolean)
    sampler: str = setting("inverse_cdf", choice(*SAMPLERS))
    merge_lora: bool = setting(True, boolean)
    share_prefill: bool = setting(True, boolean)
    stream_logprobs: bool = setting(True, boolean)
    packed_weights: bool | str = setting("auto", choice("auto", True, False))
    weights: str = setting("float32", choice(*DECODE_WEIGHTS))
    cuda_graphs: bool = setting(True, boolean)

    def __post_init__(self) -> None:
        check_settings(self, "perf.generate")
        if self.packed_weights is True and self.weights != "float32":
            raise ValueError(
                f"perf.generate.packed_weights=true packs float32 weights only and perf.generate.weights="
                f"{self.weights} samples with {self.weights} copies: set perf.generate.packed_weights=auto or false"
            )

    @classmethod
    def plain(cls) -> GenerationSettings:
        return cls(
            custom_decode=False,
            sampler="multinomial",
            merge_lora=False,
            share_prefill=False,
            stream_logprobs=False,
            packed_weights=False,
            cuda_graphs=False,
        )
