"""The distribution a sampler with top-k / top-p draws from, so the trainer can score the very same one.

With `generator.top_k` > 0 or `generator.top_p` < 1 an engine samples from a truncated distribution: the logits
(already divided by the temperature) of the tokens outside the kept set are set to -inf and the rest renormalised.
Every engine reports log-probs of that distribution (vLLM's `processed_logprobs`; the HF engine through this
module). A trainer that scores the full distribution instead sees, at every token, the log of the kept mass S:
the importance ratio carries a factor S < 1 that is no policy change (TRL #6789; prime-rl replays the truncation
on the trainer, as this module does). `Truncation.apply` replays it on the trainer's logits.

The kept set follows vLLM's `apply_top_k_top_p_pytorch` and HF's `TopKLogitsWarper` then `TopPLogitsWarper`,
which agree: top-k keeps every token whose logit is at least the k-th largest (ties kept); top-p then sorts the
top-k-renormalised probabilities in ascending order and drops each token whose cumulative sum is <= 1 - p,
always keeping the most likely one. `keep` (the sampled tokens) is never dropped: on the trainer's own weights
the sampled token is in the set by construction, but float rounding at the boundary of the nucleus, or weights
that moved since sampling, could otherwise give it -inf (prime-rl restores the label's logit likewise). Keeping
the exact sets the engine used instead (DeepSeek-V3.2's "keep sampling mask", arXiv 2512.02556) would need the
engine to return a set per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Truncation:
    """top-k then top-p, as the engines apply them (module docstring); the defaults truncate nothing."""

    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # then the smallest most-likely set with this much of the probability; 1.0 = off

    def __post_init__(self) -> None:
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"Truncation needs top_k >= 0 and 0 < top_p <= 1 (got {self.top_k}, {self.top_p})")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def dropped(self, logits: Tensor) -> Tensor:  # [..., V] float -> [..., V] bool
        """True where the sampler drops the token: the complement of the kept set (module docstring)."""
        drop = torch.zeros_like(logits, dtype=torch.bool)
        vocab = logits.shape[-1]
        if self.top_k and self.top_k < vocab:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]  # [..., 1]
            drop |= logits < kth
        if self.top_p < 1.0:
            masked = logits.masked_fill(drop, float("-inf"))
            ascending, order = masked.sort(dim=-1)  # [..., V]
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= 1.0 - self.top_p
            drop_sorted[..., -1] = False  # the most likely token always stays
            drop |= drop_sorted.scatter(-1, order, drop_sorted)
        return drop

    def apply(self, logits: Tensor, keep: Tensor | None = None) -> Tensor:  # [..., V], [...] long -> [..., V]
        """`logits` with the dropped tokens at -inf (a new tensor; differentiable in the kept ones); the tokens
        `keep` names, one per row, are never dropped."""
        if not self.active:
            return logits
        drop = self.dropped(logits.detach())
        if keep is not None:
            drop.scatter_(-1, keep.unsqueeze(-1), False)
        return logits.masked_fill(drop, float("-inf"))

    def log_probs(self, logits: Tensor, index: Tensor) -> Tensor:  # [..., V], [...] long -> [...] float32
        """log-prob of each `index` token under the truncated, renormalised distribution of `logits`."""
        kept = self.apply(logits.float(), keep=index)
        return torch.log_softmax(kept, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
