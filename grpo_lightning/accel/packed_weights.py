"""Linear layers through MKL's packed GEMM while generating: each weight packed once per call, not per matmul.

For the few rows of a decoding step (16 x 576 times 576 x 1536), MKL's `sgemm` can spend much of every call
re-packing the weight into its blocked layout; `torch.ops.mkl._mkl_reorder_linear_weight` (the op PyTorch's own
CPU freezing pass uses) packs it once beforehand. Whether that pays depends on the CPU: on some it is much faster
and bit-exact, on others the packed buffer is several times the weight's size, the call is barely faster, and
products with some row counts differ from `F.linear` by float rounding (enough to change a sampled token now and
then). Measured numbers: benchmarks/README.md.

So the default, `auto`, runs a trial per weight shape and row count, once per process (`packing_trial`: exact
equality with `F.linear` on a random input, packed size, best-of-3 speed), and packs only the shapes whose
packed product is exact, at most 1.5x the weight's size and at least 15% faster. Where it packs, generation is
bit for bit what it is without packing (tests/unit/test_packed_linears.py). `true` packs every layer (equal
within float rounding). CPU float32 with MKL only, and inference only (the packed op has no gradient):
elsewhere the context is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_lightning.accel.settings import check_packed_weights

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.15  # `auto` packs a shape only if its packed product is this much faster...
MAX_SIZE_RATIO = 1.5  # ...and its packed buffer at most this many times the weight's size
# Multiply-adds one timing of a trial runs (best of 3, each way): a 576 x 1536 weight at 16 rows gets 22 calls.
# A call's cost grows with its rows, so a group of 1,024 rows gets 2 calls of its LM head, not 64 times the work.
TRIAL_MACS = 320_000_000


def packing_available() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


@dataclass(frozen=True)
class PackingTrial:
    """How MKL's packed product compares with `F.linear` for one weight shape and row count on this CPU."""

    exact: bool  # equal to F.linear bit for bit on a random input
    size_ratio: float  # packed buffer bytes / weight bytes
    speedup: float  # F.linear time / packed time (best of 3)

    def pays(self, min_speedup: float = MIN_SPEEDUP, max_size_ratio: float = MAX_SIZE_RATIO) -> bool:
        return self.exact and self.size_ratio <= max_size_ratio and self.speedup >= min_speedup


def _best_time(fn: Callable[[], Tensor], calls: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def packing_trial(out_features: int, in_features: int, rows: int, threads: int = 0) -> PackingTrial:
    """Measure the packed product once per process for this shape (tens of ms; ~0.3 s for a 49k-row LM head at up
    to 16 rows; a larger row count times at least 2 calls, each longer: `TRIAL_MACS`).

    `threads`: the calling thread's torch thread count, a key only: MKL's blocking (and so exactness) can depend on
    it, and a sampler thread beside the trainer runs with fewer threads than the trainer (training/overlap.py)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)  # [out, in]
    x = torch.randn(rows, in_features, generator=generator)  # [rows, in]
    with torch.inference_mode():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        plain_out = nn.functional.linear(x, weight)  # [rows, out]
        packed_out = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
        calls = max(2, min(50, TRIAL_MACS // (out_features * in_features * max(rows, 16))))  # ~1-20 ms a timing
        plain_s = _best_time(lambda: nn.functional.linear(x, weight), calls)
        packed_s = _best_time(lambda: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows), calls)
    return PackingTrial(
        exact=torch.equal(plain_out, packed_out),
        size_ratio=packed.numel() * packed.element_size() / (weight.numel() * weight.element_size()),
        speedup=plain_s / packed_s,
    )


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


def _trial_pays(layer: nn.Linear, rows: int) -> bool:
    return packing_trial(layer.out_features, layer.in_features, rows, torch.get_num_threads()).pays()


@functools.cache
def _log_auto_choice(rows: int, packed: int, packable: int) -> None:
    log.debug("perf.generate.packed_weights=auto: %d of %d linear layers packed for %d rows", packed, packable, rows)


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int, mode: bool | str = True) -> Iterator[int]:
    """Inside, CPU float32 `nn.Linear`s of `model` multiply with their weight packed for `rows` rows.

    `mode=True` packs every such layer; `"auto"` only those whose shape passes `packing_trial` on this CPU;
    `False` none. Weights are read once, on entry: do not change them inside. Yields how many layers were packed.
    """
    mode = check_packed_weights(mode)
    candidates = [m for m in model.modules() if _packable(m)] if mode and packing_available() else []
    layers = [m for m in candidates if _trial_pays(m, rows)] if mode == "auto" else candidates
    if mode == "auto" and candidates:
        _log_auto_choice(rows, len(layers), len(candidates))
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
