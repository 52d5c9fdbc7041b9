"""Sampling with lower-precision copies of the linear weights (`perf.generate.weights`): a rollout speed lever.

A decoding step reads every weight of the model once, so on a CPU it is bound by how many bytes the weights take.
Inside `low_precision_linears(model, weights)` every `nn.Linear` of the model (the attention and MLP projections,
LoRA's A and B when they are not merged, and the LM head, the largest matrix) multiplies with a copy of its weight
made once on entry:

* `bfloat16`: the weight (and bias) cast to bfloat16; the layer's input is cast to bfloat16 and its output back
  to the input's dtype. On a CPU with AMX / AVX512-BF16 the bf16 product reads half the bytes and runs on the
  bf16 units.
* `int8`: weight-only int8, per output channel and symmetric: `scale_o = max_i |w_oi| / 127` (rounded up to the
  scale's dtype, so every `|w_oi| / scale_o <= 127`), `q_oi = round(w_oi / scale_o)`, and the product
  `x @ (q * scale)^T` through `torch.ops.aten._weight_int8pack_mm` (dequantized on the fly where a torch build
  lacks the op, or for a layer whose input width is not a multiple of 16, which that kernel cannot take). The
  activations and scales are bfloat16: the CPU kernel is vectorised for bf16 activations and about 20x slower
  with float32 ones. CPU only: on another device it is a one-line error.
* `float32` (the default): nothing changes; the policy's own weights, as they are, sample.

Embeddings, norms, rotary embeddings, attention and the residual stream stay in the policy's dtype (float32):
only the linear layers compute in low precision, and each one's output is back in the policy's dtype. The
copies are new tensors: the policy's parameters, their dtype, `requires_grad` and the optimizer's view of them
are never touched; the layers' `forward` is put back on exit. A weight shared by two layers (tied embeddings and
LM head) is copied once.

The rollouts then come from another distribution than the trainer's pi_old, by the rounding of the copies: the
engine's log-probs are those of the low-precision forward that sampled, and the rollout correction
(`loss.rollout_correction.enabled: auto`, docs/algorithm.md) turns on for `bfloat16` and `int8`
(its `engine_dtype` reads `correction_dtype(weights)` for the HF engine; accel/settings.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_lightning.accel.settings import DECODE_WEIGHTS

INT8_MAX = 127
INT8_KERNEL_BLOCK = 16  # _weight_int8pack_mm's CPU kernel: in_features a multiple of this (int8_matmul)


def check_decode_weights(weights: str) -> str:
    """The value, or a ValueError naming `perf.generate.weights`."""
    if weights not in DECODE_WEIGHTS:
        raise ValueError(f"perf.generate.weights must be one of {', '.join(DECODE_WEIGHTS)} (got {weights!r})")
    return weights


def int8_op_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _round_up(values: Tensor, dtype: torch.dtype) -> Tensor:
    """`values` (positive float32) in `dtype`, each rounded to the nearest representable value >= it."""
    rounded = values.to(dtype)
    below = rounded.float() < values
    return torch.where(below, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)


def quantize_int8(weight: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: `(q [out, in] int8, scale [out] scale_dtype)`, `w ~ q * scale[:, None]`.

    `scale_o = max_i |w_oi| / 127`, rounded up to `scale_dtype` (1 for an all-zero row), so `|w - q * scale|` is at
    most `scale / 2` elementwise and no value is clipped."""
    w = weight.detach().float()  # [out, in]
    scale = w.abs().amax(dim=1) / INT8_MAX  # [out]
    scale = _round_up(torch.where(scale > 0, scale, torch.ones_like(scale)), scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:  # [out, in] int8, [out] -> [out, in] float32
    return q.float() * scale.float()[:, None]


def int8_matmul(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:  # [N, in] (scale's dtype) -> [N, out]
    """`x @ (q * scale)^T` with torch's weight-only int8 kernel; dequantized on the fly where a torch build has no
    such kernel, or where `in` is not a multiple of 16 (the CPU kernel reads 16 inputs at a time: with other
    widths it gives wrong sums or crashes; LoRA's A and B of a small rank take this path)."""
    if int8_op_available() and x.shape[-1] % INT8_KERNEL_BLOCK == 0:
        return torch.ops.aten._weight_int8pack_mm(x, q, scale)
    weight = q.float() * scale.float()[:, None]  # exact: an 8-bit integer times a scale of <= 24 significant bits
    return nn.functional.linear(x.float(), weight).to(x.dtype)


def _int8_forward(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(scale.dtype).contiguous()  # [N, in]
    out = int8_matmul(rows, q, scale).reshape(*x.shape[:-1], q.shape[0]).to(x.dtype)  # [..., out]
    return out if bias is None else out + bias.to(x.dtype)


def _cast_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.weight.is_floating_point() and m.weight.layout == torch.strided
    ]


def check_device(weights: str, device: torch.device) -> None:
    """int8 is CPU-only: a one-line ValueError naming `perf.generate.weights` on any other device."""
    if weights == "int8" and device.type != "cpu":
        raise ValueError(
            f"perf.generate.weights=int8 runs on the CPU only (torch's _weight_int8pack_mm CPU kernel); the policy "
            f"is on {device.type}: use perf.generate.weights=bfloat16 or float32 there"
        )


@contextlib.contextmanager
def low_precision_linears(model: nn.Module, weights: str = "float32") -> Iterator[int]:
    """Inside, every `nn.Linear` of `model` computes with a `weights` copy of its weight made on entry.

    Weights are read once, on entry: enter after merging LoRA (`merged_lora`) and change no weight inside. Yields
    how many layers compute in low precision (0 for `float32`, where nothing changes)."""
    check_decode_weights(weights)
    if weights == "float32":
        yield 0
        return
    layers = _linears(model)
    for layer in layers:
        check_device(weights, layer.weight.device)
    saved: list[tuple[nn.Linear, object]] = []
    copies: dict[int, tuple[Tensor, ...]] = {}  # id(weight) -> its copy, so a shared weight is copied once
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.weight.detach()
                if id(layer.weight) not in copies:
                    if weights == "int8":
                        copies[id(layer.weight)] = quantize_int8(weight, _int8_activation_dtype(weight))
                    else:
                        copies[id(layer.weight)] = (weight.to(torch.bfloat16),)
                bias = None if layer.bias is None else layer.bias.detach()
                if weights == "int8":
                    q, scale = copies[id(layer.weight)]
                    forward = functools.partial(_int8_forward, q=q, scale=scale, bias=bias)
                else:
                    (low,) = copies[id(layer.weight)]
                    low_bias = None if bias is None else bias.to(low.dtype)
                    forward = functools.partial(_cast_forward, weight=low, bias=low_bias)
                saved.append((layer, layer.__dict__.get("forward")))
                layer.forward = forward
        yield len(layers)
    finally:
        for layer, previous in reversed(saved):
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous


def _int8_activation_dtype(weight: Tensor) -> torch.dtype:
    """The int8 kernel's activation and scale dtype: half precision (the CPU kernel is vectorised for it)."""
    return torch.float16 if weight.dtype == torch.float16 else torch.bfloat16
