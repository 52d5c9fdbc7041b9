"""LoRA's update written into the base layer's output in place: one `addmm_` instead of peft's three passes.

peft computes `result + lora_B(lora_A(x)) * scaling`, which allocates three fresh `[tokens, out]` tensors (B's
output, its scaled copy, the sum). In a training forward every one of them is new memory (autograd keeps the
activations alive), and on this CPU such a pass cost 1.4 to 2 ms for a 508 x 1536 block against 0.1 to 0.2 ms
on warm memory (benchmarks/README.md). The fused form, `result.addmm_(lora_A(x), (scaling * B)^T)`, is the same
sum up to float rounding with the same gradients, and writes no new `[tokens, out]` tensor.

It is installed per module instance (`module.forward`); peft's class is untouched. Anything other than plain
LoRA on a `nn.Linear` with matching dtypes runs peft's own forward: adapters disabled or merged, several or
mixed adapters, LoRA variants (DoRA, ...), dropout, autocast.
"""

from __future__ import annotations

import types

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import Tensor, nn


def _plain_lora_adapter(module: LoraLinear, x: Tensor, kwargs: dict) -> str | None:
    """The single active adapter when the fused form computes exactly what peft would, else None."""
    adapters = module.active_adapters
    # Autocast must be asked per device type: the bare `torch.is_autocast_enabled()` only reports CUDA, so under
    # CPU autocast (trainer.precision=bf16-mixed / 16-mixed) the fused addmm_ would mix bf16 and fp32 operands.
    autocast = torch.is_autocast_enabled(x.device.type)
    if module.disable_adapters or module.merged or kwargs or len(adapters) != 1 or autocast:
        return None
    name = adapters[0]
    if name not in module.lora_A or name in module.lora_variant:
        return None
    if not isinstance(module.lora_dropout[name], nn.Identity) or type(module.base_layer) is not nn.Linear:
        return None
    if not (
        x.dtype
        == module.lora_A[name].weight.dtype
        == module.lora_B[name].weight.dtype
        == module.base_layer.weight.dtype
    ):
        return None
    return name


def fused_lora_forward(self: LoraLinear, x: Tensor, *args, **kwargs) -> Tensor:
    name = None if args else _plain_lora_adapter(self, x, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)  # [..., out]; F.linear's backward saves its inputs, not this output
    down = self.lora_A[name](x)  # [..., r]
    up = self.lora_B[name].weight * self.scaling[name]  # [out, r]
    result.view(-1, result.shape[-1]).addmm_(down.reshape(-1, down.shape[-1]), up.t())
    return result


def install_fused_lora_forward(model: nn.Module) -> int:
    """Give every peft LoRA `Linear` in `model` the fused forward; returns how many modules got it."""
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.forward = types.MethodType(fused_lora_forward, module)
            count += 1
    return count


def remove_fused_lora_forward(model: nn.Module) -> None:
    """Back to peft's own forward everywhere."""
    for module in model.modules():
        if isinstance(module, LoraLinear) and "forward" in module.__dict__:
            del module.forward
