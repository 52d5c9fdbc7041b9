"""Completion log-probs without the full forward: shared prompt prefixes and a chunked, recomputed LM head.

The plain path runs every row of a micro-batch over prompt + completion and materialises the logits at the
completion positions, `[B, C, V]`, before the log-softmax (plus a copy divided by the temperature, plus their
gradient in the backward). Three levers, each exact up to float rounding (tests/unit/test_forward.py):

* Prefix sharing: the G completions of a group share their prompt. The backbone runs each DISTINCT prompt once
  (`use_cache=True`), the key/value cache is gathered to the B rows, and the completions run on top of it, so
  gradients flow through each shared prefix once. Rows are matched by their (left-padded) prompt block, so any
  variant's groups (GRPO, STORPO's prompt) share automatically; a micro-batch of distinct prompts takes the
  plain path.
* Runs by length: completions end at different lengths (EOS), and a padded batch computes every row to the
  longest. Rows are split into runs of similar length (`length_runs`: the padded tokens plus a fixed cost per
  extra backbone call, minimised), each run computed only as far as its longest row; the LM head runs on real
  positions only. Padding positions get log-prob 0.
* Completion logits chunk by chunk (`chunked_head.py`): the LM head, the temperature, the logsumexp and the
  gather run on `chunk_tokens` hidden states at a time, so no more than one chunk's `[chunk, V]` logits ever
  exist; a frozen head's gradient is taken in the forward.

Models whose logits are not `lm_head(hidden)` (final-logit soft-capping, logit scales) take the plain path.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from grpo_lightning.accel.chunked_head import NO_TRUNCATION, chunked_logprobs
from grpo_lightning.accel.entropy_terms import EntropySink, EntropyTerms, entropy_and_logit_grad, token_entropy
from grpo_lightning.accel.head_input import restrided_head_input
from grpo_lightning.accel.hf_internals import Cache, DynamicLayer
from grpo_lightning.algorithm.losses import selective_log_softmax
from grpo_lightning.algorithm.rollouts import position_ids_from_mask
from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.types import RolloutBatch

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
RUN_CALL_COST_TOKENS = 32
"""What one more backbone call costs, in padded tokens, when rows are split into runs of similar length."""


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


def length_runs(lengths: list[int], call_cost_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Rows grouped into runs of similar length, `[(rows, run length)]`, each run padded to its longest row.

    Minimises `sum(len(rows) * run length) + call_cost_tokens * runs` over the partitions of the rows sorted by
    length into contiguous runs (dynamic programming, O(B^2)); ties go to fewer runs. `call_cost_tokens` is
    the fixed cost of one more backbone call (launch overhead, smaller matmuls), in padded-token equivalents
    (default `RUN_CALL_COST_TOKENS`).
    """
    if call_cost_tokens is None:
        call_cost_tokens = RUN_CALL_COST_TOKENS
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    best = [0.0] + [float("inf")] * len(order)  # best[j]: cost of the first j sorted rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):  # the last run is sorted rows i..j-1, padded to sorted_lengths[j - 1]
            cost = best[i] + (j - i) * sorted_lengths[j - 1] + call_cost_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(order)
    while j > 0:
        runs.append((order[cut[j] : j], sorted_lengths[j - 1]))
        j = cut[j]
    return runs[::-1]


def _select_cache_rows(cache: Cache, rows: Tensor) -> Cache:
    """A shallow copy of `cache` whose layers hold rows `rows` of its keys / values: [U, ...] -> [len(rows), ...].

    `index_select`, whose backward is an `index_add_`: advanced indexing's backward is an accumulating
    `index_put_`, which took ~1.5 ms per layer tensor on CPU (0.36 s of a benchmark round's 11.5 s).
    """
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        selected = copy.copy(layer)
        if layer.is_initialized:
            selected.keys = layer.keys.index_select(0, rows)
            selected.values = layer.values.index_select(0, rows)
        out.layers.append(selected)
    return out


def _select_in_place(cache: Cache, rows: Tensor) -> Cache:
    cache.batch_select_indices(rows)  # [U, ...] -> [B, ...]; differentiable gather
    return cache


def completion_lengths(batch: RolloutBatch) -> list[int]:
    """Real completion tokens per row, at least 1 (the first completion position is always scored)."""
    return batch.sequence_mask.sum(-1).long().clamp(min=1).tolist()


def completion_hidden(
    backbone: nn.Module, batch: RolloutBatch, share_prefix: bool = True, by_length: bool = True
) -> Tensor:
    """Last hidden states at the positions that predict the completion tokens: [B, C, H].

    Position t of the result is the state after `prompt + completion[:t]`, i.e. the one scoring completion[t].
    With `by_length`, rows run in runs of similar completion length (`length_runs`), each only as far as its
    longest row, and positions past a row's end hold zeros instead of states computed over padding.
    """
    b, p, c = len(batch), batch.prompt_len, batch.completion_ids.shape[1]
    positions = position_ids_from_mask(batch.attention_mask)  # [B, P + C]
    runs = length_runs(completion_lengths(batch)) if by_length else [(list(range(b)), c)]
    groups = shared_prompts(batch) if share_prefix else None
    parts = []  # per run: [rows, run length, H]
    if groups is None:
        for rows, length in runs:
            idx = torch.tensor(rows, device=batch.input_ids.device)
            out = backbone(
                input_ids=batch.input_ids[idx, : p + length - 1],
                attention_mask=batch.attention_mask[idx, : p + length - 1],
                position_ids=positions[idx, : p + length - 1],
                use_cache=False,
            )
            parts.append(out.last_hidden_state[:, p - 1 :])
        return _rows_in_order(parts, runs, c)
    first, inverse = groups
    prefix = backbone(
        input_ids=batch.input_ids[first, :p],
        attention_mask=batch.attention_mask[first, :p],
        position_ids=positions[first, :p],
        use_cache=True,
    )
    last = prefix.last_hidden_state[:, -1:]  # [U, 1, H]: scores completion token 0
    cache = prefix.past_key_values
    copyable = all(isinstance(layer, DynamicLayer) for layer in cache.layers)
    if not copyable:  # other layer kinds (e.g. linear-attention states) are gathered in place, once: one run
        runs = [(list(range(b)), c)]
    for rows, length in runs:
        idx = torch.tensor(rows, device=inverse.device)
        prompt_of_row = inverse.index_select(0, idx)  # [rows]
        first_state = last.index_select(0, prompt_of_row)  # [rows, 1, H]
        if length == 1:
            parts.append(first_state)
            continue
        row_cache = _select_cache_rows(cache, prompt_of_row) if copyable else _select_in_place(cache, prompt_of_row)
        rest = backbone(
            input_ids=batch.input_ids[idx, p : p + length - 1],
            attention_mask=batch.attention_mask[idx, : p + length - 1],
            position_ids=positions[idx, p : p + length - 1],
            past_key_values=row_cache,
            use_cache=True,
        )
        parts.append(torch.cat([first_state, rest.last_hidden_state], dim=1))
    return _rows_in_order(parts, runs, c)


def _rows_in_order(parts: list[Tensor], runs: list[tuple[list[int], int]], width: int) -> Tensor:  # [B, C, H]
    """The runs' hidden states ([rows, run length, H] each) zero-padded to `width` and put back in row order."""
    if len(runs) == 1 and runs[0][0] == sorted(runs[0][0]):
        return nn.functional.pad(parts[0], (0, 0, 0, width - runs[0][1]))
    stacked = torch.cat([nn.functional.pad(h, (0, 0, 0, width - h.shape[1])) for h in parts])  # [B, C, H]
    order = torch.tensor([row for rows, _ in runs for row in rows], device=stacked.device)
    return stacked.index_select(0, torch.argsort(order))


def completion_logits_and_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    with_logits: bool,
    share_prefix: bool = True,
    chunk_tokens: int | None = 128,
    by_length: bool = True,
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[Tensor | None, Tensor]:
    """(logits [B, C, V] / T or None, log-probs [B, C], 0 on padding) of the completion tokens.

    The log-probs are over the tokens `truncation` keeps (top-k / top-p, algorithm/truncation.py), the
    distribution the engine sampled from; the logits returned are the untruncated ones.

    See the module docstring. `chunk_tokens=None` materialises the logits even when not asked for; with
    `share_prefix=False` and `by_length=False` too, this is the plain path (one forward of the model,
    `logits_to_keep`), which the tests compare against. Logits at padding positions are unspecified.
    """
    logits, logp, _ = _completion_forward(
        model, batch, temperature, with_logits, share_prefix, chunk_tokens, by_length, truncation=truncation
    )
    return logits, logp


def completion_logprobs_with_entropy(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    weights: Tensor,  # [B, C] weight of each position's entropy in the gradient (the trained-token mask)
    share_prefix: bool = True,
    chunk_tokens: int | None = 128,
    by_length: bool = True,
    with_grad: bool = True,
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[Tensor, EntropyTerms]:
    """The training forward's log-probs [B, C] (bitwise those of `completion_logits_and_logprobs`) and its token
    entropies with what their parameter gradient needs (`EntropyTerms`; `with_grad=False`: entropies only),
    from the same logits (the entropies of the untruncated distribution)."""
    _, logp, terms = _completion_forward(
        model, batch, temperature, False, share_prefix, chunk_tokens, by_length, weights, with_grad, truncation
    )
    return logp, terms


def _logits_terms(logits: Tensor, weights: Tensor, with_grad: bool, rows: int = 2) -> EntropyTerms:  # [B, C, V]
    """EntropyTerms of materialised logits, `rows` rows at a time."""
    entropy = torch.zeros(logits.shape[:2], dtype=torch.float64, device=logits.device)
    grad = torch.empty_like(logits) if with_grad else logits.new_zeros(())
    for start in range(0, logits.shape[0], rows):
        end = start + rows
        if not with_grad:
            entropy[start:end] = token_entropy(logits[start:end])
            continue
        entropy[start:end], chunk_grad = entropy_and_logit_grad(logits[start:end].detach(), weights[start:end])
        grad[start:end] = chunk_grad.to(logits.dtype)
    return EntropyTerms(entropy=entropy, anchor=logits, anchor_grad=grad, head_grads=[])


def _plain_logprobs(logits: Tensor, batch: RolloutBatch, truncation: Truncation) -> Tensor:  # [B, C, V] -> [B, C]
    """The completion tokens' log-probs of materialised logits, 0 on padding."""
    real = batch.sequence_mask.bool()
    logits = truncation.apply(logits, keep=batch.completion_ids)
    return selective_log_softmax(logits, batch.completion_ids).masked_fill(~real, 0.0)


def _completion_forward(
    model: nn.Module,
    batch: RolloutBatch,
    temperature: float,
    with_logits: bool,
    share_prefix: bool,
    chunk_tokens: int | None,
    by_length: bool,
    entropy_weights: Tensor | None = None,
    entropy_grad: bool = True,
    truncation: Truncation = NO_TRUNCATION,
) -> tuple[Tensor | None, Tensor, EntropyTerms | None]:
    """Both public forwards (`completion_logits_and_logprobs`, `completion_logprobs_with_entropy`), which give every
    lever; `entropy_weights` asks for the entropy terms too."""
    real = batch.sequence_mask.bool()  # [B, C]
    parts = backbone_and_head(model) if share_prefix or chunk_tokens or by_length else None
    if parts is None:  # plain path: the model's own logits at completion positions
        completion_len = batch.completion_ids.shape[1]
        with restrided_head_input(model):  # half precision on a CPU: no copy of the head per row
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask),
                logits_to_keep=completion_len + 1,
                use_cache=False,
            )
        logits = out.logits[:, :-1, :] / temperature  # [B, C, V]: position t predicts token t + 1
        terms = None if entropy_weights is None else _logits_terms(logits, entropy_weights, entropy_grad)
        return logits, _plain_logprobs(logits, batch, truncation), terms
    backbone, head = parts
    hidden = completion_hidden(backbone, batch, share_prefix, by_length)  # [B, C, H]
    if not chunk_tokens:
        logits = head(hidden) / temperature  # [B, C, V]
        terms = None if entropy_weights is None else _logits_terms(logits, entropy_weights, entropy_grad)
        return logits, _plain_logprobs(logits, batch, truncation), terms
    # The log-probs (hence the loss and its gradient) come from the chunked head whether or not observers ask
    # for logits or entropies, so a probe leaves training bitwise unchanged (tests/probes/test_zero_impact.py).
    # The head runs on real positions only: `index_select`, whose backward is an `index_add_`.
    positions = real.reshape(-1).nonzero().squeeze(-1)  # [N]
    real_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [N, H]
    real_ids = batch.completion_ids.reshape(-1).index_select(0, positions)  # [N]
    sink = None
    if entropy_weights is not None:
        weights = entropy_weights.reshape(-1).index_select(0, positions)
        sink = EntropySink(real_hidden, weights, head, temperature, entropy_grad)
    logp = chunked_logprobs(real_hidden, head, real_ids, temperature, chunk_tokens, sink, truncation)  # [N]
    logprobs = logp.new_zeros(real.shape).masked_scatter(real, logp)  # [B, C]
    terms = None
    if sink is not None:
        entropy = sink.entropy.new_zeros(real.shape).masked_scatter(real, sink.entropy)  # [B, C]
        head_grads = [
            (p, g) for p, g in ((head.weight, sink.grad_weight), (head.bias, sink.grad_bias)) if g is not None
        ]
        terms = EntropyTerms(entropy, real_hidden, sink.grad_hidden.to(real_hidden.dtype), head_grads)
    return (head(hidden) / temperature if with_logits else None), logprobs, terms
