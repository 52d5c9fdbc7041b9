"""Cheaper HF generation, each piece exact up to float rounding (tests/unit/test_fast_generation.py).

* `merged_lora(model)`: for the duration of generation every LoRA linear layer computes with ONE weight,
  `W + scale * B @ A`, and the adapters are bypassed, so a decoding step runs one matmul per layer instead of
  three plus an add. The merged weights are new tensors swapped in and the original `Parameter` objects are
  put back afterwards: the frozen base is never modified (peft's in-place merge/unmerge would round it).
* `shared_prefill(...)`: the G samples of a prompt share its prefix. The prompt runs once (all but its last
  token), the KV cache is repeated G times and `generate` continues from it, instead of `generate` expanding
  the prompt G times before its prefill.
* `StepLogprobRecorder`: the log-prob of each sampled token under log_softmax(raw logits / T), taken with
  forward hooks (the LM head's output, then the next step's input token), so no `[N, V]` tensor per step is
  retained (`output_logits=True` kept T_new of them until the end of the call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_lightning.algorithm.rollouts import position_ids_from_mask
from grpo_lightning.algorithm.truncation import Truncation


def _lora_layers(model: nn.Module) -> list[nn.Module] | None:
    """The active LoRA linear layers of a peft model; None when merging is not supported (not peft, DoRA, ...)."""
    if not hasattr(model, "disable_adapter"):
        return None
    layers = []
    for module in model.modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "get_delta_weight"):
            continue
        base = module.get_base_layer()
        active = [a for a in module.active_adapters if a in module.lora_A]
        if not isinstance(base, nn.Linear) or getattr(module, "merged", False):
            return None
        if any(module.use_dora.get(a, False) for a in active) or getattr(module, "fan_in_fan_out", False):
            return None
        layers.append(module)
    return layers or None


class _DeltaScratch:
    """Each layer's `scale * B @ A` computed into buffers made once per merge, as peft's `get_delta_weight` computes
    it (in the adapter's dtype, float32 on a CPU for a half-precision adapter, rounded to the adapter's dtype, then
    to the weight's): the same bits, without a new `[out, in]` tensor (two in half precision) per layer. Those,
    freed while the merged weights were being made, left the heap fragmented: sampling a bf16 Qwen2.5-1.5B on a
    CPU held up to 1.6 GiB more than its merged copy (2.6 GiB above the loaded model with the buffers, 3.7 without)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.largest = max(module.get_base_layer().weight.numel() for module in layers)
        self.buffers: dict[torch.dtype, Tensor] = {}

    def _buffer(self, dtype: torch.dtype, shape: torch.Size, device: torch.device) -> Tensor:
        if dtype not in self.buffers:
            self.buffers[dtype] = torch.empty(self.largest, dtype=dtype, device=device)
        return self.buffers[dtype][: shape.numel()].view(shape)

    def delta(self, module: nn.Module, adapter: str, weight_dtype: torch.dtype) -> Tensor:  # [out, in]
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight  # [r, in], [out, r]
        adapter_dtype = b.dtype
        if b.device.type == "cpu" and adapter_dtype in (torch.float16, torch.bfloat16):  # peft's rule
            a, b = a.float(), b.float()
        delta = self._buffer(a.dtype, torch.Size((b.shape[0], a.shape[1])), a.device)
        torch.mm(b, a, out=delta).mul_(module.scaling[adapter])
        for dtype in (adapter_dtype, weight_dtype):  # peft returns the adapter's dtype; the merge adds the weight's
            if delta.dtype != dtype:
                delta = self._buffer(dtype, delta.shape, delta.device).copy_(delta)
        return delta


@contextlib.contextmanager
def merged_lora(model: nn.Module) -> Iterator[bool]:
    """Generate with LoRA merged into new weight tensors; yields whether it merged (False: unchanged model)."""
    layers = _lora_layers(model)
    if layers is None:
        yield False
        return
    saved = []
    scratch = _DeltaScratch(layers)
    try:
        with torch.no_grad():
            for module in layers:
                base = module.get_base_layer()
                weight = base.weight.detach().clone()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight += scratch.delta(module, adapter, weight.dtype)
                saved.append((base, base.weight))
                base.weight = nn.Parameter(weight, requires_grad=False)
        del scratch
        with model.disable_adapter():
            yield True
    finally:
        for base, original in saved:
            base.weight = original


def shared_prefill(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, cache: object | None = None
) -> tuple[Tensor, Tensor, object]:
    """Prefill each (left-padded) prefix once; return input ids and mask repeated `num_samples` times and a cache.

    The cache holds all but the last prefix token, so `generate` still runs one step on the prompt (where the
    first sampled token's logits come from). Rows are repeated in place order: prefix i -> rows i*K .. i*K+K-1,
    as `num_return_sequences` lays them out. `cache`: an empty cache object to fill (default: the model's own).
    """
    with torch.inference_mode():
        out = model(
            input_ids=input_ids[:, :-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids_from_mask(attention_mask[:, :-1]),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    cache = out.past_key_values
    cache.batch_repeat_interleave(num_samples)
    return input_ids.repeat_interleave(num_samples, 0), attention_mask.repeat_interleave(num_samples, 0), cache


class StepLogprobRecorder:
    """Log-prob of every token `generate` feeds back, under log_softmax(logits / T) of the step that sampled it,
    over the tokens `truncation` (the sampler's top-k / top-p) keeps.

    A forward hook on the LM head keeps the last step's `[N, V]` logits / T; a pre-hook on the input
    embeddings scores them at the tokens the next step consumes (the sampled ones). `finish(last_tokens)`
    scores the final step. Rows that already ended get pad tokens fed back; callers cut after EOS.
    """

    def __init__(self, model: nn.Module, temperature: float, truncation: Truncation) -> None:
        self.temperature = temperature
        self.truncation = truncation
        self.columns: list[Tensor] = []
        self.pending: Tensor | None = None
        self.head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.handles = []

    def __enter__(self) -> StepLogprobRecorder:
        self.handles = [
            self.embed.register_forward_pre_hook(self._on_input),
            self.head.register_forward_hook(self._on_logits),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _on_input(self, module: nn.Module, args: tuple) -> None:
        if self.pending is not None:
            tokens = args[0][:, -1:]  # [N, 1]: what the previous step sampled
            logp = self.truncation.log_probs(self.pending, tokens[:, 0].to(self.pending.device))  # [N]
            self.columns.append(logp.unsqueeze(-1).cpu())
            self.pending = None

    def _on_logits(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        self.pending = output[:, -1].float() / self.temperature  # [N, V]

    def finish(self, last_tokens: Tensor) -> Tensor:  # [N] -> [N, T_new] float32
        if self.pending is not None:
            self._on_input(None, (last_tokens[:, None],))
        return torch.cat(self.columns, dim=-1) if self.columns else torch.zeros(len(last_tokens), 0)
