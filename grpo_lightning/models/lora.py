"""LoRA through peft, or full fine-tuning, and the reference policy each needs (docs/algorithm.md, Reference).

LoRA shares the base weights with its reference (adapters disabled at scoring time, no copy); full fine-tuning
keeps a frozen copy, and beta = 0 needs none.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_lightning.schema import boolean, check_settings, integer, number, setting, strings


@dataclass
class LoraSettings:
    """`model.lora`: LoRA through peft; `enabled: false` means full fine-tuning."""

    enabled: bool = setting(True, boolean)
    r: int = setting(16, integer(1))
    alpha: float = setting(32, number(above=0))
    dropout: float = setting(0.0, number(low=0, below=1))
    target_modules: str | list[str] = setting("all-linear", strings)

    def __post_init__(self) -> None:
        check_settings(self, "model.lora")


def wrap_policy(model: nn.Module, lora: LoraSettings, needs_reference: bool) -> tuple[nn.Module, nn.Module | None]:
    """Return (policy, frozen reference or None). LoRA needs no reference copy: see the module docstring."""
    if lora.enabled:
        from peft import LoraConfig, get_peft_model

        target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=target,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, peft_config), None
    reference = None
    if needs_reference:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    return model, reference


def adapter_off(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter weights of the base model: every LoRA B matrix zero, so each layer's update B A x is exactly 0
    (self-play's `base` opponent). Sampling through swapped weights keeps one code path for every opponent; peft's
    `disable_adapter` would not reach the merged copies the HF engine samples through."""
    if not any("lora_B" in name for name in weights):
        raise ValueError("the policy has no LoRA adapter to turn off (model.lora.enabled=false?)")
    return {name: torch.zeros_like(w) if "lora_B" in name else w for name, w in weights.items()}
