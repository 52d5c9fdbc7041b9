"""The LM head's input re-laid to standard strides on a CPU in half precision, so no copy of the head's weight per
row is made.

transformers computes `lm_head(hidden[:, -k:, :])` (`logits_to_keep`), a view whose batch stride is that of the
whole sequence. On a CPU in bfloat16 or float16, torch's `linear` cannot fold such a 3-D view into one matrix
product: it broadcasts the weight to `[rows, H, V]`, makes it contiguous and runs a batched product, so one call
holds a copy of the head's weight for every row. Measured with torch 2.13 on a 2-core AMD EPYC Zen 4: 16 rows of a
`[16, 64, 1536]` bf16 slice against Qwen2.5-1.5B's `[151936, 1536]` head peaked 6.96 GiB above the call (0.43 GiB
of weight), 2 rows 0.87 GiB; the same slice re-laid: 0.01 GiB. float32 takes another kernel and is unaffected
(nothing is changed there, so float32 results stay bitwise those of the plain call). The copy made here is
`[rows, k, H]`, the size of the slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

HALF_PRECISION = (torch.bfloat16, torch.float16)


def _restride(_module: nn.Module, args: tuple) -> tuple | None:
    hidden = args[0] if args else None
    if not isinstance(hidden, Tensor) or hidden.device.type != "cpu" or hidden.dtype not in HALF_PRECISION:
        return None
    if hidden.dim() < 3:
        return None
    return (hidden.clone(memory_format=torch.contiguous_format), *args[1:])


@contextlib.contextmanager
def restrided_head_input(model: nn.Module) -> Iterator[None]:
    """Inside, `model`'s output embeddings (the LM head) take their input re-laid to standard strides when it is a
    CPU half-precision tensor (the module docstring); nothing changes elsewhere. A model without output embeddings
    is left as it is."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(_restride)
    try:
        yield
    finally:
        handle.remove()
