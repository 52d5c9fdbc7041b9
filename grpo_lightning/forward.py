"""Completion log-probs without the full forward: shared prompt prefixes and a chunked, recomputed LM head.

The plain path runs every row of a micro-batch over prompt + completion and materialises the logits at the
completion positions, `[B, C, V]`, before the log-softmax (plus a copy divided by the temperature, plus their
gradient in the backward). Two levers, each exact up to float rounding (tests/unit/test_forward.py):

* Prefix sharing: the G completions of a group share their prompt. The backbone runs each DISTINCT prompt once
  (`use_cache=True`), the key/value cache is gathered to the B rows, and the completions run on top of it, so
  gradients flow through each shared prefix once. Rows are matched by their (left-padded) prompt block, so any
  variant's groups (GRPO, STORPO's prompt) share automatically; a micro-batch of distinct prompts takes the
  plain path.
* Completion logits chunk by chunk: the LM head, the temperature, the logsumexp and the gather run on
  `chunk_tokens` hidden states at a time, so no more than one chunk's `[chunk, V]` logits ever exist. When the
  head is frozen (LoRA), `HeadLogprobs` also takes the gradient with respect to the hidden states in the
  forward, `d logp / d h = (W[token] - softmax @ W) / T`, a `[chunk, H]` tensor, so the backward is a
  multiplication (no recomputed logits, no `[chunk, V]` gradient). A trainable head recomputes each chunk
  under activation checkpointing instead.

Models whose logits are not `lm_head(hidden)` (final-logit soft-capping, logit scales) take the plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_lightning.losses import selective_log_softmax
from grpo_lightning.rollouts import RolloutBatch, position_ids_from_mask

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder backbone, LM head) of a causal LM (or a peft wrapper of one); None when logits != lm_head(h)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    prefix = getattr(base, "base_model_prefix", None)
    backbone = getattr(base, prefix, None) if prefix else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if config is None or backbone is None or not isinstance(head, nn.Linear):
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text_config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return backbone, head


def shared_prompts(batch: RolloutBatch) -> tuple[Tensor, Tensor] | None:
    """(first row of each distinct prompt [U], row -> distinct prompt [B]); None when no two rows share one."""
    p = batch.prompt_len
    key = torch.cat([batch.input_ids[:, :p], batch.attention_mask[:, :p]], dim=1)  # [B, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B]
    num_unique = int(inverse.max()) + 1
    if num_unique == len(batch):
        return None
    rows = torch.arange(len(batch), device=inverse.device)
    first = torch.full((num_unique,), len(batch), device=inverse.device).scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def completion_hidden(backbone: nn.Module, batch: RolloutBatch, share_prefix: bool = True) -> Tensor:
    """Last hidden states at the positions that predict the completion tokens: [B, C, H].

    Position t of the result is the state after `prompt + completion[:t]`, i.e. the one scoring completion[t].
    """
    p, c = batch.prompt_len, batch.completion_ids.shape[1]
    positions = position_ids_from_mask(batch.attention_mask)  # [B, P + C]
    groups = shared_prompts(batch) if share_prefix else None
    if groups is None:
        out = backbone(
            input_ids=batch.input_ids[:, : p + c - 1],
            attention_mask=batch.attention_mask[:, : p + c - 1],
            position_ids=positions[:, : p + c - 1],
            use_cache=False,
        )
        return out.last_hidden_state[:, p - 1 :]
    first, inverse = groups
    prefix = backbone(
        input_ids=batch.input_ids[first, :p],
        attention_mask=batch.attention_mask[first, :p],
        position_ids=positions[first, :p],
        use_cache=True,
    )
    last = prefix.last_hidden_state[:, -1:][inverse]  # [B, 1, H]: scores completion token 0
    if c == 1:
        return last
    cache = prefix.past_key_values
    cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...]; differentiable gather
    rest = backbone(
        input_ids=batch.input_ids[:, p : p + c - 1],
        attention_mask=batch.attention_mask[:, : p + c - 1],
        position_ids=positions[:, p : p + c - 1],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([last, rest.last_hidden_state], dim=1)


class HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ W^T + b) / T)[index] for one chunk, with its gradient in `hidden` found in the forward.

    Only for a frozen head (W and b get no gradient). The `[n, V]` logits are overwritten in place by the
    unnormalised softmax; the saved state is `[n, H]`.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, temperature: float) -> Tensor:
        logits = nn.functional.linear(hidden, weight, bias).float()  # [n, V]
        if temperature != 1.0:
            logits.div_(temperature)
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
        return (grad_logp.unsqueeze(-1) * grad_hidden).to(ctx.hidden_dtype), None, None, None, None


def _chunk_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, temperature: float) -> Tensor:
    logits = nn.functional.linear(hidden, weight, bias).float() / temperature  # [n, V]
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_logprobs(
    hidden: Tensor,  # [B, C, H]
    head: nn.Linear,
    index: Tensor,  # [B, C] long
    temperature: float,
    chunk_tokens: int = 128,
) -> Tensor:  # [B, C] float32
    """log_softmax(head(hidden) / T)[index], `chunk_tokens` positions at a time (module docstring)."""
    b, c, h = hidden.shape
    flat, flat_index = hidden.reshape(b * c, h), index.reshape(b * c)
    head_trains = any(p is not None and p.requires_grad for p in (head.weight, head.bias))
    recompute = torch.is_grad_enabled() and head_trains
    out = []
    for start in range(0, b * c, chunk_tokens):
        args = (flat[start : start + chunk_tokens], head.weight, head.bias, flat_index[start : start + chunk_tokens])
        if not head_trains:
            out.append(HeadLogprobs.apply(*args, temperature))
        elif recompute:
            out.append(checkpoint(_chunk_logprobs, *args, temperature, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(*args, temperature))
    return torch.cat(out).reshape(b, c) if out else hidden.new_zeros((b, c), dtype=torch.float32)


def completion_logits_and_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    with_logits: bool,
    share_prefix: bool = True,
    chunk_tokens: int | None = 128,
) -> tuple[Tensor | None, Tensor]:
    """(logits [B, C, V] / T or None, log-probs [B, C]) of the completion tokens; see the module docstring.

    `chunk_tokens=None` materialises the logits even when not asked for; with `share_prefix=False` too, this
    is the plain path (one forward of the model, `logits_to_keep`), which the tests compare against.
    """
    parts = backbone_and_head(model) if share_prefix or chunk_tokens else None
    if parts is None:  # plain path: the model's own logits at completion positions
        completion_len = batch.completion_ids.shape[1]
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
            logits_to_keep=completion_len + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :] / temperature  # [B, C, V]: position t predicts token t + 1
        return logits, selective_log_softmax(logits, batch.completion_ids)
    backbone, head = parts
    hidden = completion_hidden(backbone, batch, share_prefix)  # [B, C, H]
    if not chunk_tokens:
        logits = head(hidden) / temperature  # [B, C, V]
        return logits, selective_log_softmax(logits, batch.completion_ids)
    # The log-probs (hence the loss and its gradient) come from the chunked head whether or not observers ask
    # for logits, so a probe that does leaves training bitwise unchanged (tests/probes/test_zero_impact.py).
    logprobs = chunked_logprobs(hidden, head, batch.completion_ids, temperature, chunk_tokens)
    return (head(hidden) / temperature if with_logits else None), logprobs
