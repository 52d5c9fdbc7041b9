"""Activation checkpointing of the decoder layers (`perf.forward.activation_checkpointing`).

A plain backward keeps, per token and layer, about 10 h + 5 i + 2 kv activations (app/memory.py); at Qwen2.5-7B's
shape and 2,048-token completions that is over 100 GiB for one group of 8. Checkpointed, each layer keeps only
its input hidden state ([tokens, h]) and runs its forward again in the backward, so at most one layer's
activations live at a time: h values per token and layer instead of about 10 h + 5 i + 2 kv (37 times fewer at
Qwen2.5-7B's shape), for one more forward of the backbone (about a third more compute in the training phase).
TRL trains with the same trade by default (`gradient_checkpointing=True`).

The layers are transformers' own `GradientCheckpointingLayer`s, switched on by transformers
(`activation_checkpointing_enable`; `gradient_checkpointing_enable` before it was renamed), non-reentrant
(`torch.utils.checkpoint` with `use_reentrant=False`): the recomputation draws the same dropout masks (the RNG
state is restored) and needs no special handling of the frozen embeddings. The layers checkpoint only in training
mode, so sampling (the engines put the model in eval mode) runs as before. Exact up to float rounding:
tests/unit/test_activation_checkpointing.py compares the log-probs and gradients with the plain forward's.
"""

from __future__ import annotations

from torch import nn


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer of `model` (a transformers causal LM, or a peft wrapper of one).

    Raises a ValueError naming `perf.forward.activation_checkpointing` for a model whose layers transformers
    cannot checkpoint (`supports_gradient_checkpointing` false: remote code, some architectures).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"perf.forward.activation_checkpointing=true: {type(base).__name__} does not support activation "
            "checkpointing in transformers; set perf.forward.activation_checkpointing=false"
        )
    options = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # the name newer transformers use (the old one warns)
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:  # older transformers (the GPU images' 5.17)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
