"""Linear layers through MKL's packed GEMM while generating: each weight packed once per call, not per matmul.

For the few rows of a decoding step (16 x 576 times 576 x 1536), MKL's `sgemm` spends much of every call
re-packing the weight into its blocked layout: 147 us a call here, against 81 us with the weight packed once
beforehand by `torch.ops.mkl._mkl_reorder_linear_weight` (the op PyTorch's own CPU freezing pass uses). The
packed product runs the same kernel, and its outputs equal `F.linear`'s bit for bit
(tests/unit/test_packed_linears.py). A call with another number of rows than the weight was packed for (the prefill,
the last rows of a batch) runs the plain product with the original weight, so it is exact too, just not faster.

The cost is a packed copy of the weights (about the model's size) held while generating. CPU float32 with
MKL only, and inference only (the packed op has no gradient): elsewhere the context is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor, nn


def packing_available() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.layout == torch.strided
    )


def _packed_forward(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    if x.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return nn.functional.linear(x, weight, bias)  # the packed op has no autograd formula
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Inside, every CPU float32 `nn.Linear` of `model` multiplies with its weight packed for `rows` rows.

    Weights are read once, on entry: do not change them inside. Yields how many layers were packed.
    """
    layers = [m for m in model.modules() if _packable(m)] if packing_available() else []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.weight.detach()
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                bias = None if layer.bias is None else layer.bias.detach()
                layer.forward = functools.partial(_packed_forward, packed=packed, weight=weight, bias=bias, rows=rows)
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
