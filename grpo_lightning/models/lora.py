"""LoRA through peft, or full fine-tuning, and the reference policy each needs (docs/algorithm.md, Reference).

LoRA shares the base weights with its reference (adapters disabled at scoring time, no copy); full fine-tuning
keeps a frozen copy, and beta = 0 needs none.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn


@dataclass
class LoraSettings:
    """`model.lora`: LoRA through peft; `enabled: false` means full fine-tuning."""

    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def __post_init__(self) -> None:
        if self.enabled and self.r < 1:
            raise ValueError(f"model.lora.r must be >= 1 (got {self.r})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must be in [0, 1) (got {self.dropout})")


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
