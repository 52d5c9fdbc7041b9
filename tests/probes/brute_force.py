"""Ground truth for the probe tests: per-completion quantities by autograd through a plain forward of the model
and a separately written loss / entropy, never through the training code's chunked paths."""

from __future__ import annotations

import lightning as L
import torch

from grpo_lightning.algorithm.rollouts import position_ids_from_mask


class UnequalLengths:
    """A variant wrapper that cuts each completion to a different length (as EOS would) and leaves the last
    completion of each round with no trained token (branch point at its end, as a STORPO continuation)."""

    def __init__(self, variant) -> None:
        self.variant = variant

    def __getattr__(self, name):
        return getattr(self.variant, name)

    def generate_rollouts(self, *args, **kwargs):
        rollouts = self.variant.generate_rollouts(*args, **kwargs)
        for k, r in enumerate(rollouts):
            keep = max(1, min(len(r.completion_ids), 2 + (5 * k) % 13))
            r.completion_ids, r.gen_logprobs = r.completion_ids[:keep], r.gen_logprobs[:keep]
            if r.token_advantages is not None:  # STORPO's tree credit: one per kept token
                r.token_advantages = r.token_advantages[:keep]
            r.truncated = False
        rollouts[-1].branch_point = len(rollouts[-1].completion_ids)
        return rollouts


PINNED_SHAPE = (
    "variant.num_generations=4",
    "data.prompts_per_round=4",
    "data.dynamic_sampling.enabled=false",
    "generator.temperature=1.0",
)
"""The round these checks were built on, whatever the defaults: 4 groups of 4 completions, one group per
micro-batch (so a round has 4 micro-batches of 4 completions), no dynamic sampling, and temperature 1. The tiny
random model is near-uniform: its per-sequence entropies differ by ~5e-5 nats, so their correlations are only
resolved to the tolerances asserted where that spread is widest, at temperature 1."""


def plain_logprobs(model, batch, temperature: float) -> torch.Tensor:  # [B, C]
    """log pi(completion token) from one full forward of the model (its own logits)."""
    logits = plain_logits(model, batch, temperature)
    return torch.log_softmax(logits.double(), -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def plain_logits(model, batch, temperature: float) -> torch.Tensor:  # [B, C, V]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids_from_mask(batch.attention_mask),
    )
    p = batch.prompt_len
    return out.logits[:, p - 1 : -1] / temperature


def completion_values(logp, batch, loss_type: str, max_len: int, step_completions: int, step_tokens: float):
    """One loss value per completion, in the loss type's sample unit (beta = 0, on-policy: ratio 1).

    The per-token loss is -A exp(logp - logp.detach()) (value -A, gradient -A grad logp).
    """
    mask = batch.completion_mask.double()
    per_token = -batch.advantages.double()[:, None] * torch.exp(logp - logp.detach()) * mask  # [B, C]
    token_sum = per_token.sum(-1)  # [B]
    n = mask.sum(-1)
    if loss_type in ("grpo", "bnpo"):
        return token_sum / n.clamp(min=1)
    if loss_type == "dr_grpo":
        return token_sum / max_len
    return token_sum * step_completions / step_tokens  # dapo: token sum / the step's mean completion length


def completion_weights(batch, loss_type: str) -> torch.Tensor:  # [B]
    return batch.completion_mask.sum(-1).double() if loss_type == "bnpo" else torch.ones(len(batch)).double()


def flat_grad(value, params) -> torch.Tensor:
    grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1).double() for p, g in zip(params, grads, strict=True)]
    )


class StepBatches(L.Callback):
    """The micro-batches of the running optimizer step."""

    def __init__(self) -> None:
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.batches = []
        self.batches.append(batch)
