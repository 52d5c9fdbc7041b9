"""Trained weights -> a vLLM engine: parameter names, LoRA merged out of place, and the start-up name check.

vLLM's `model.load_weights([(name, tensor), ...])` takes Hugging Face checkpoint names and fuses them itself
(q/k/v into `qkv_proj`, gate/up into `gate_up_proj`), which is how TRL's colocate mode pushes weights. So the
trainer pushes checkpoint names: a peft name such as `base_model.model.model.layers.0.self_attn.q_proj.
base_layer.weight` becomes `model.layers.0.self_attn.q_proj.weight`, and LoRA's own parameters are never sent.
`check_name_mapping` proves once, at start, that every pushed name lands on an engine parameter (directly or
through a known fusion) and that every engine parameter is fed by one, so a sync can neither fail half-way
nor leave part of the engine on old weights.

LoRA is merged out of place: the pushed tensor is W + scaling * B @ A (peft's own `get_delta_weight`, so the
arithmetic is peft's `merge_adapter`) in a fresh tensor, and the policy is never written. peft's
`merge_adapter()` / `unmerge_adapter()` add and subtract the delta in place, which is not bitwise reversible
(rounding: measured on a tiny Llama, 7 of 26 parameters changed after ten round trips in float32 and in
bfloat16), and here the frozen base is also the KL reference (models.py), so every sync would nudge both.
LoRA training only changes the adapted layers, so a LoRA sync pushes just those (the engine already holds
the rest, loaded from the same checkpoint); full fine-tuning pushes every parameter.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator

import torch
from torch import Tensor, nn

from grpo_lightning.sharding import gathered_in_pieces, is_sharded

# vLLM fuses these Hugging Face projections into one parameter (its models' `stacked_params_mapping`).
STACKED_PARAMS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_PEFT_PREFIX = "base_model.model."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def checkpoint_name(param_name: str) -> str | None:
    """A policy parameter's name as in a Hugging Face checkpoint; None for LoRA's own parameters."""
    parts = param_name.split(".")
    if any(p.startswith("lora_") or p == "original_module" for p in parts):
        return None
    name = param_name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    return _MODULES_TO_SAVE.sub(".", name)


def engine_param_name(name: str, engine_names: Collection[str]) -> str | None:
    """The engine parameter a checkpoint name loads into: the same name, or the fused one (q_proj -> qkv_proj)."""
    if name in engine_names:
        return name
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in STACKED_PARAMS:
            fused = ".".join([*parts[:i], STACKED_PARAMS[part], *parts[i + 1 :]])
            if fused in engine_names:
                return fused
    return None


def check_name_mapping(names: Iterable[str], engine_names: Collection[str]) -> None:
    """Raise ValueError unless the checkpoint names and the engine's parameters correspond one-to-fused."""
    names = list(names)
    engine_names = set(engine_names)
    mapped = {n: engine_param_name(n, engine_names) for n in names}
    unknown = sorted(n for n, target in mapped.items() if target is None)
    unfed = sorted(engine_names - set(mapped.values()))
    if not unknown and not unfed:
        return
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} trainer parameters have no vLLM parameter (e.g. {', '.join(unknown[:3])})")
    if unfed:
        problems.append(f"{len(unfed)} vLLM parameters would never be updated (e.g. {', '.join(unfed[:3])})")
    raise ValueError(
        "generator=vllm cannot sync this model: " + "; ".join(problems) + ". The weight sync pushes Hugging Face "
        "names and understands vLLM's q/k/v -> qkv_proj and gate/up -> gate_up_proj fusing; use generator=hf "
        "for this model architecture"
    )


def policy_checkpoint_names(policy: nn.Module) -> list[str]:
    """Every name a full push sends (the start-up check compares these with the engine's parameters)."""
    names = (checkpoint_name(name) for name, _ in policy.named_parameters())
    return [name for name in names if name is not None]


def policy_weights(policy: nn.Module, adapted_only: bool) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, tensor) pairs to push, LoRA layers merged out of place; the policy is not modified.

    `adapted_only`: only what LoRA training can change (merged LoRA layers, and parameters trained directly such
    as peft's `modules_to_save`); the engine already holds the rest.

    A sharded policy (trainer=fsdp) is gathered one decoder layer at a time and each tensor copied out, so no
    process holds a second full copy of the weights; every process must iterate to the end (each gather is a
    collective), the ones that push nothing as well (`drain`).
    """
    modules = dict(policy.named_modules())
    copy_out = is_sharded(policy)  # a gathered piece is freed when the next one is gathered
    for piece in gathered_in_pieces(policy):
        for name, param in piece:
            target = checkpoint_name(name)
            if target is None:
                continue
            layer = _lora_layer_of(name, modules)
            if layer is not None and name.endswith(".weight"):
                yield target, merged_weight(layer)  # a new tensor
            elif not adapted_only or param.requires_grad:
                yield target, param.detach().clone() if copy_out else param.detach()


def drain(weights: Iterable[tuple[str, Tensor]]) -> None:
    """Run through `weights` without keeping them: a process that pushes nothing takes part in a sharded
    policy's gathers (`policy_weights`)."""
    for _ in weights:
        pass


@torch.no_grad()
def merged_weight(layer: nn.Module) -> Tensor:
    """A LoRA layer's effective weight W + sum of its active adapters' deltas, as a new tensor."""
    weight = layer.get_base_layer().weight.detach()
    if getattr(layer, "merged", False):  # someone merged in place already: W holds the sum
        return weight.clone()
    merged = weight.clone()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            raise ValueError("generator=vllm merges plain LoRA only (DoRA / lora_bias adapters are not supported)")
        merged += layer.get_delta_weight(adapter).to(merged.dtype)  # [out, in] = scaling * B @ A
    return merged


def _lora_layer_of(param_name: str, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The peft LoRA layer whose `base_layer` holds this parameter, if any."""
    if ".base_layer." not in param_name:
        return None
    owner = param_name.rsplit(".base_layer.", 1)[0]
    layer = modules.get(owner)
    return layer if layer is not None and hasattr(layer, "get_delta_weight") else None


def chunked(weights: Iterable[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `max_bytes` (one tensor may exceed it alone).

    Merged LoRA tensors are new allocations: pushing in chunks bounds the extra GPU memory a sync needs.
    """
    chunk: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def repack_tied_weights(model: nn.Module) -> None:
    """vLLM's CPU build, after a layerwise reload: repack the layers that share another layer's weight (a tied LM
    head). Runs inside the engine (`LLM.apply_model`, or a weight-transfer backend in a server's worker).

    The reload repacks the layers whose checkpoint names arrived; a tied `lm_head` has none (its weight is
    `embed_tokens.weight`), so it would keep the GEMM handle packed from the embeddings it was built with and
    score with stale embeddings after a full fine-tuning push. Re-running its `process_weights_after_loading`
    packs the current values.
    """
    seen: set[int] = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        method = getattr(module, "quant_method", None)
        if weight is None or method is None:
            continue
        if id(weight) in seen:
            method.process_weights_after_loading(module)
        seen.add(id(weight))
