"""Token entropies of the training forward's own logits and the gradient of their weighted sum (entropy probe).

Computed in float64 from the logits the chunked head (`chunked_head.py`) or the plain path produces anyway: no
second forward, no `[B, C, V]` tensor on the chunked path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def _shifted_softmax_terms(logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # [..., V]
    """(z - max z, exp(z - max z), their sums S, entropy) in float64; H = log S - sum(u z') / S."""
    z = logits.detach().to(torch.float64, copy=True)
    z.sub_(z.amax(dim=-1, keepdim=True))
    u = z.exp()
    total = u.sum(-1)
    entropy = total.log() - torch.einsum("...v,...v->...", u, z) / total
    return z, u, total, entropy


@torch.no_grad()
def token_entropy(logits: Tensor) -> Tensor:  # [..., V] -> [...] float64
    """H = -sum_v p log p of softmax(logits), computed in float64 (see `entropy_and_logit_grad`)."""
    return _shifted_softmax_terms(logits)[3]


@torch.no_grad()
def entropy_and_logit_grad(logits: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:  # [..., V]
    """(H = -sum_v p log p of softmax(logits), float64 [...]; d(sum weights * H) / d logits = -w p (log p + H),
    float32 [..., V]).

    The entropy is computed in float64 from the given logits: one step's entropy change (~1e-7 nats per token
    at small learning rates) is below the float32 rounding of a ~10-nat sum over the vocabulary.
    """
    z, u, total, entropy = _shifted_softmax_terms(logits)
    scale = (entropy - total.log()).unsqueeze(-1)  # log p + H = z' - log S + H
    grad = u.div_(total.unsqueeze(-1)).mul_(z.add_(scale)).neg_()  # in place: -p (log p + H)
    if weights is not None:
        grad.mul_(weights.to(grad.dtype).unsqueeze(-1))
    return entropy, grad.float()


class EntropySink:
    """Per-position entropy of the chunked LM head's logits and the gradient of sum_t w_t H_t with respect to the
    head's input (and, for a trainable head, its weight and bias), from the logits the training forward computes
    anyway: no second forward, no `[B, C, V]` tensor.

    For a chunk of hidden states h [n, H] with logits z = (h W^T + b) / T: dH/dh = (dH/dz) W / T,
    dH/dW = (dH/dz)^T h / T, dH/db = sum_rows dH/dz / T.
    """

    def __init__(
        self, hidden: Tensor, weights: Tensor, head: nn.Linear, temperature: float, with_grad: bool = True
    ) -> None:  # [N, H], [N]
        self.hidden, self.weights, self.head, self.temperature = hidden.detach(), weights, head, temperature
        self.with_grad = with_grad
        self.entropy = torch.zeros(hidden.shape[0], dtype=torch.float64, device=hidden.device)  # [N]
        self.grad_hidden = torch.zeros(hidden.shape if with_grad else (0,), dtype=torch.float32, device=hidden.device)
        trains = with_grad and head.weight.requires_grad
        self.grad_weight = torch.zeros_like(head.weight, dtype=torch.float32) if trains else None
        bias = head.bias
        bias_trains = with_grad and bias is not None and bias.requires_grad
        self.grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_trains else None
        self._seen: set[int] = set()

    def at(self, start: int):
        return lambda logits: self._chunk(start, logits)

    @torch.no_grad()
    def _chunk(self, start: int, logits: Tensor) -> None:  # [n, V] float32, already / T
        if start in self._seen:
            return
        self._seen.add(start)
        end = start + logits.shape[0]
        if not self.with_grad:
            self.entropy[start:end] = token_entropy(logits)
            return
        entropy, grad = entropy_and_logit_grad(logits.detach(), self.weights[start:end])
        self.entropy[start:end] = entropy
        weight = self.head.weight.detach()
        self.grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).float() / self.temperature
        if self.grad_weight is not None:
            self.grad_weight.addmm_(grad.T, self.hidden[start:end].float(), alpha=1.0 / self.temperature)
        if self.grad_bias is not None:
            self.grad_bias.add_(grad.sum(0), alpha=1.0 / self.temperature)


@dataclass
class EntropyTerms:
    """What the entropy probe needs of one training forward (`completion_logprobs_with_entropy`).

    `entropy` [B, C] float64 (0 where not computed); the gradient of sum_t w_t H_t with respect to the trainable
    parameters is `torch.autograd.grad(anchor, params, anchor_grad)` plus `head_grads` (a trainable head's
    direct term, which does not pass through `anchor`).
    """

    entropy: Tensor
    anchor: Tensor
    anchor_grad: Tensor
    head_grads: list[tuple[nn.Parameter, Tensor]]

    def gradient_surrogate(self) -> Tensor:  # []
        """A scalar whose gradient with respect to the trainable parameters is that of sum_t w_t H_t (its value
        means nothing): `anchor` against its gradient, plus a trainable head's direct terms. The entropy bonus
        (`loss.entropy_coef`) backpropagates through it."""
        total = (self.anchor * self.anchor_grad.to(self.anchor.dtype)).sum()
        for param, grad in self.head_grads:
            total = total + (param * grad.to(param.dtype)).sum()
        return total
