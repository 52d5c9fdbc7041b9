"""Our own sampling loop for HF models: a pre-allocated KV cache and an O(V) exact sampler.

Measured on the embedded model (16 rows x 128 new tokens, 2 CPU cores; benchmarks/README.md), `generate`
spends its time on three things besides the weight-bound matmuls: `DynamicCache` re-concatenating every layer's
keys and values at every step (O(T^2) copying), `torch.multinomial` drawing one exponential per vocabulary entry
per row (~14 ms a step for 16 x 49152), and bookkeeping. This loop keeps the model call and replaces the rest:

* `PreallocatedLayer`: each layer's keys / values live in one buffer sized for prompt + max_new_tokens; a step
  writes its column in place and attention reads a view of the filled part (same values as the concatenation).
* `sample_inverse_cdf`: one uniform per row, searched in the float64 cumulative distribution: an exact draw
  from the same categorical distribution (tests/unit/test_decode.py checks frequencies against the
  probabilities), with other random numbers than `torch.multinomial`. `sampler="multinomial"` draws exactly as
  `generate` does: with it the loop reproduces `generate`'s tokens for the same RNG state.

* Finished rows leave the batch: once a quarter of the rows in it have emitted an EOS, the loop keeps only the
  others (their KV cache rows, mask and positions). A decode step costs about the same for every row in the
  batch, so without this a round whose replies are mostly short pays for every row up to the longest reply
  (on the embedded model, 128 rows with a mean of 11 new tokens and a budget of 48 ran 48 full-width steps).
  The random stream stays that of the full batch: `inverse_cdf` draws one uniform for every row of the call at
  every step and uses those of the rows still running, so the draws of a row do not depend on when others
  finish. `multinomial` keeps every row to the end (what `generate` does), so that it still reproduces
  `generate`'s tokens.

Top-k and top-p are those of HF's logits warpers, in HF's order, applied to logits / T (algorithm/truncation.py,
which the trainer replays), and each token's log-prob is that of the truncated distribution it was drawn from. A
row's tokens after its EOS are the pad token with log-prob 0 (`generate` feeds the pad token); callers cut after
the EOS.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo_lightning.accel.hf_internals import Cache, DynamicCache, DynamicLayer, get_layer_types_and_kwargs
from grpo_lightning.accel.settings import check_sampler
from grpo_lightning.algorithm.rollouts import position_ids_from_mask
from grpo_lightning.algorithm.truncation import Truncation


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV cache layer backed by `[B, H, capacity, D]` buffers, written in place.

    `keys` / `values` are views of the filled columns, so everything that reads a `DynamicLayer` (mask sizes,
    `get_seq_length`, attention) sees the same tensors a concatenating cache would hold.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_zeros(b, h, self.capacity, dk)  # [B, H, capacity, Dk]
        self.value_buffer = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} positions)")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]  # [B, H, length, Dk]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PreallocatedLayer does not crop")


def new_cache(model: nn.Module, capacity: int) -> Cache:
    """A pre-allocated cache when every layer is plain full attention; else the model's usual `DynamicCache`."""
    config = model.config.get_text_config(decoder=True)
    try:
        layer_types, _ = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError):  # configs this helper does not understand: stay generic
        layer_types = None
    if layer_types and all(t == "full_attention" for t in layer_types):
        return Cache(layers=[PreallocatedLayer(capacity) for _ in layer_types])
    return DynamicCache(config=model.config)


class EagerSteps:
    """Each step's logits from the model called on the step's tokens with the KV cache (any cache): the prefill,
    then one token per row and step, the attention mask growing by one column a step."""

    def __init__(self, model: nn.Module, cache: Cache, attention_mask: Tensor, max_new_tokens: int) -> None:
        self.model, self.cache = model, cache
        n = attention_mask.shape[0]
        self.mask = torch.cat([attention_mask, attention_mask.new_ones(n, max_new_tokens)], dim=1)  # [N, L + T]
        self.length = cache.get_seq_length()  # columns the cache holds

    def logits(self, ids: Tensor, positions: Tensor) -> Tensor:  # [B, S], [B, S] -> [B, V], the model's dtype
        end = self.length + ids.shape[1]
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask[:, :end],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.length = end
        return out.logits[:, -1]

    def keep(self, rows: Tensor) -> None:  # [B'] indices of the rows that stay in the batch
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]


def sample_inverse_cdf(
    probs: Tensor, uniform: Tensor | None = None, rng: torch.Generator | None = None
) -> Tensor:  # [N, V], [N] -> [N] long
    """Index i with probability probs[i]: the first i whose cumulative probability exceeds u * total.

    Cumulated in float64 so rounding moves no visible probability mass; zero-probability entries are never
    chosen (their cumulative value equals the previous one, which u * total already reached). `rng`: where the
    uniforms come from (None: the global RNG).
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    if uniform is None:
        uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device, generator=rng)
    target = uniform.double().unsqueeze(-1) * cdf[:, -1:]  # [N, 1]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def attention_backends_for_decoding(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, scaled-dot-product attention without the cuDNN backend while sampling (prefill and decode steps).

    cuDNN's attention builds an execution graph for each new shape, and a decode step's key length grows by one
    every step, so with cuDNN every step of every layer builds a graph. PyTorch picks cuDNN for bf16 / fp16 on
    Hopper: on an H100 this made a bf16 decode step of the embedded model about 3x the CPU time of an fp32 one
    (~2 ms per attention call; benchmarks/README.md). The other backends (flash, memory-efficient, math) keep
    PyTorch's priority order and compute the same attention; elsewhere this is a no-op.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.inference_mode()
def sample_loop(
    model: nn.Module,
    input_ids: Tensor,  # [N, L] left-padded
    attention_mask: Tensor,  # [N, L]
    cache: Cache,  # empty, or holding the first L - 1 positions of every row
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    sampler: str = "inverse_cdf",
    rng: torch.Generator | None = None,
    compact: bool = True,
    steps: EagerSteps | None = None,
) -> tuple[Tensor, Tensor]:  # tokens [N, T_new] long, log-probs [N, T_new] float32
    """Sample up to `max_new_tokens` per row; the log-prob of each token is under log_softmax(logits / T), over
    the tokens `top_k` / `top_p` keep (algorithm/truncation.py).

    `rng`: the generator every draw comes from; None draws from the global RNG. An explicit one is what lets
    a background thread sample without touching the trainer's RNG (training/overlap.py). `compact`: finished
    rows leave the batch (with `sampler="inverse_cdf"`, greedy included; the module's docstring); False keeps every
    row to the end. `steps`: how the model computes each step's logits over `cache` (default `EagerSteps`; the
    CUDA-graph path is graph_decode.StaticSteps); sampling is the same whichever it is."""
    check_sampler(sampler)
    n = input_ids.shape[0]
    device = input_ids.device
    cached = cache.get_seq_length()
    steps = steps if steps is not None else EagerSteps(model, cache, attention_mask, max_new_tokens)
    positions = position_ids_from_mask(attention_mask)  # [N, L]: real tokens count from 0 under left padding
    step_ids, step_positions = input_ids[:, cached:], positions[:, cached:]
    next_position = positions[:, -1:] + 1  # [N, 1]
    truncation = Truncation(top_k, top_p)  # HF's top-k then top-p warpers, and vLLM's (algorithm/truncation.py)
    eos = torch.tensor(eos_token_ids, device=device)
    drop_finished = compact and sampler == "inverse_cdf"
    rows = torch.arange(n, device=device)  # [B]: the call's row of each row still in the batch (B <= N)
    unfinished = torch.ones(n, dtype=torch.bool, device=device)  # [B]
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # [N, T]
    logprobs = torch.zeros(n, max_new_tokens, device=device)  # [N, T]
    taken = 0  # steps run
    for step in range(max_new_tokens):
        logits = steps.logits(step_ids, step_positions).float()  # [B, V]
        scores = logits / temperature if temperature != 1.0 else logits
        if greedy:
            token = scores.argmax(dim=-1)
        else:
            warped = truncation.apply(scores)  # [B, V]: the dropped tokens at -inf
            probs = torch.softmax(warped, dim=-1)  # [B, V]
            if sampler == "multinomial":
                token = torch.multinomial(probs, 1, generator=rng).squeeze(1)
            else:  # the whole call's uniforms, those of the rows in the batch: a stream independent of B
                uniform = torch.rand(n, dtype=torch.float64, device=device, generator=rng)[rows]  # [B]
                token = sample_inverse_cdf(probs, uniform)
        token = torch.where(unfinished, token, pad_token_id)  # [B]
        # [B]: under the distribution sampled from (truncated, renormalised), what the trainer scores
        logprob = torch.log_softmax(scores if greedy else warped, dim=-1).gather(-1, token[:, None]).squeeze(1)
        tokens[rows, step] = token
        logprobs[rows, step] = torch.where(unfinished, logprob, 0.0)
        taken = step + 1
        unfinished &= ~torch.isin(token, eos)
        running = int(unfinished.sum())
        if running == 0:
            break
        step_ids, step_positions = token[:, None], next_position
        next_position = next_position + 1
        if drop_finished and running <= 3 * len(rows) // 4:
            keep = unfinished.nonzero().squeeze(1)  # [B']
            steps.keep(keep)
            rows, unfinished = rows[keep], unfinished[keep]
            step_ids, step_positions, next_position = step_ids[keep], step_positions[keep], next_position[keep]
    return tokens[:, :taken].cpu(), logprobs[:, :taken].cpu()
