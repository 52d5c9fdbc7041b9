"""The LM head and log-softmax a chunk of positions at a time, so no more than one chunk's `[chunk, V]` logits exist.

When the head is frozen (LoRA), `HeadLogprobs` takes the gradient with respect to the hidden states in the
forward, `d logp / d h = (W[token] - softmax @ W) / T`, a `[chunk, H]` tensor, so the backward is a
multiplication (no recomputed logits, no `[chunk, V]` gradient). A trainable head recomputes each chunk under
activation checkpointing instead. Exact up to float rounding (tests/unit/test_head_logprobs.py).

With top-k / top-p sampling (`truncation`, algorithm/truncation.py) the log-softmax is over the kept tokens: the
dropped ones are -inf before the softmax, so `softmax @ W` and the gradient are those of the truncated
distribution the engine sampled from. An observer (`sink`) sees the logits before the truncation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_lightning.accel.entropy_terms import EntropySink
from grpo_lightning.algorithm.truncation import Truncation

NO_TRUNCATION = Truncation()


class HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ W^T + b) / T)[index] for one chunk, with its gradient in `hidden` found in the forward.

    Only for a frozen head (W and b get no gradient). The `[n, V]` logits are overwritten in place by the
    unnormalised softmax; the saved state is `[n, H]`.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        index: Tensor,
        temperature: float,
        sink=None,
        truncation: Truncation = NO_TRUNCATION,
    ) -> Tensor:
        logits = nn.functional.linear(hidden, weight, bias).float()  # [n, V]
        if temperature != 1.0:
            logits.div_(temperature)
        if sink is not None:  # an observer reads this chunk's logits (entropy probe) before they are overwritten
            sink(logits)
        logits = truncation.apply(logits, keep=index)  # [n, V]: dropped tokens at -inf (exp: 0)
        chosen = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [n]
        peak = logits.amax(dim=-1, keepdim=True)  # [n, 1]
        unnormalised = logits.sub_(peak).exp_()  # [n, V], in place: exp(z - max)
        total = unnormalised.sum(dim=-1, keepdim=True)  # [n, 1]
        logp = chosen - (peak + total.log()).squeeze(-1)  # [n]
        ctx.hidden_dtype = hidden.dtype
        if ctx.needs_input_grad[0]:
            expected = (unnormalised.to(weight.dtype) @ weight).float() / total  # [n, H]: softmax @ W
            ctx.save_for_backward((weight[index].float() - expected) / temperature)  # d logp / d hidden
        return logp

    @staticmethod
    def backward(ctx, grad_logp: Tensor):  # [n]
        (grad_hidden,) = ctx.saved_tensors
        return (grad_logp.unsqueeze(-1) * grad_hidden).to(ctx.hidden_dtype), None, None, None, None, None, None


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    index: Tensor,
    temperature: float,
    sink=None,
    truncation: Truncation = NO_TRUNCATION,
) -> Tensor:
    logits = nn.functional.linear(hidden, weight, bias).float() / temperature  # [n, V]
    if sink is not None:
        sink(logits)
    logits = truncation.apply(logits, keep=index)
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_logprobs(
    hidden: Tensor,  # [..., H]
    head: nn.Linear,
    index: Tensor,  # [...] long
    temperature: float,
    chunk_tokens: int = 128,
    sink: EntropySink | None = None,
    truncation: Truncation = NO_TRUNCATION,
) -> Tensor:  # [...] float32
    """log_softmax(head(hidden) / T)[index], over the tokens `truncation` keeps, `chunk_tokens` positions at a
    time (module docstring).

    `sink` (entropy probe) sees each chunk's float32 logits / T once, in the forward, before they are freed.
    """
    flat, flat_index = hidden.reshape(-1, hidden.shape[-1]), index.reshape(-1)
    head_trains = any(p is not None and p.requires_grad for p in (head.weight, head.bias))
    recompute = torch.is_grad_enabled() and head_trains
    out = []
    for start in range(0, flat.shape[0], chunk_tokens):
        args = (flat[start : start + chunk_tokens], head.weight, head.bias, flat_index[start : start + chunk_tokens])
        chunk_sink = None if sink is None else sink.at(start)
        if not head_trains:
            out.append(HeadLogprobs.apply(*args, temperature, chunk_sink, truncation))
        elif recompute:  # the recomputation in the backward calls the sink again: it ignores a chunk seen once
            out.append(checkpoint(_chunk_logprobs, *args, temperature, chunk_sink, truncation, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(*args, temperature, chunk_sink, truncation))
    return torch.cat(out).reshape(index.shape) if out else hidden.new_zeros(index.shape, dtype=torch.float32)
