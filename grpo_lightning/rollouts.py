"""Rollout data types: one sampled completion (`Rollout`) and padded tensor batches of them (`RolloutBatch`).

A rollout round is a list of `Rollout`s produced by a variant. The data module collates micro-batches of whole
advantage groups into `RolloutBatch`es; the training step consumes them. Prompts are LEFT-padded and completions
RIGHT-padded (TRL's layout), so every completion starts at the same column `prompt_len` and the completion
log-probs of the whole batch are one `[B, C]` slice of the logits.

Pure: imports neither Lightning nor Hydra.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass
class Rollout:
    """One sampled completion of one prompt, scored, with its advantage."""

    prompt_ids: list[int]
    """Token ids of the chat-formatted prompt (no padding)."""
    completion_ids: list[int]
    """Sampled token ids, up to and including the EOS token when one was produced."""
    gen_logprobs: list[float]
    """Log-prob of each completion token under the generator's sampling distribution (len = completion)."""
    reward: float
    group_id: int
    """Samples with the same group id share one advantage baseline (docs/algorithm.md, Advantages)."""
    truncated: bool
    """True when the completion hit max_new_tokens without an EOS."""
    text: str = ""
    """Decoded completion, for logging."""
    advantage: float = 0.0
    branch_point: int = 0
    """Number of leading completion tokens NOT trained on (STORPO continuations); 0 trains on all."""
    answer_extracted: bool = False
    """Whether the reward function found an answer in the completion (format rate)."""
    reward_terms: dict[str, float] = field(default_factory=dict)
    """Unweighted value of each reward term (`reward.terms.<name>`); `reward` is their weighted, transformed sum."""

    def __post_init__(self) -> None:
        if len(self.gen_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Rollout.gen_logprobs has {len(self.gen_logprobs)} entries for "
                f"{len(self.completion_ids)} completion tokens"
            )


@dataclass
class RolloutBatch:
    """Padded tensors of B rollouts, ready for a forward pass.

    Column layout of `input_ids`: [left pad | prompt | completion | right pad]; completion token j of every
    row sits at column `prompt_len + j`.
    """

    input_ids: Tensor  # [B, P + C] long
    attention_mask: Tensor  # [B, P + C] long, 1 on real tokens
    completion_mask: Tensor  # [B, C] float, 1 on trained completion tokens (after the branch point)
    gen_logprobs: Tensor  # [B, C] float32, generator log-probs (0 on padding)
    advantages: Tensor  # [B] float32
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] long
    branch_points: Tensor  # [B] long, leading completion tokens not trained on (STORPO continuations; else 0)
    prompt_len: int
    """P: width of the left-padded prompt block."""
    old_logprobs: Tensor | None = None  # [B, C] float32, policy log-probs before the round's first update
    num_tokens_in_step: float = 0.0
    """Trained tokens in the whole optimizer step this micro-batch belongs to (for loss.type=dapo)."""

    @property
    def completion_ids(self) -> Tensor:  # [B, C]
        return self.input_ids[:, self.prompt_len :]

    @property
    def sequence_mask(self) -> Tensor:  # [B, C] real (non-pad) completion tokens, trained or not
        return self.attention_mask[:, self.prompt_len :].float()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)


def collate_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> RolloutBatch:
    """Pad a list of rollouts into a `RolloutBatch` (prompts left-padded, completions right-padded)."""
    if not rollouts:
        raise ValueError("collate_rollouts needs at least one rollout")
    p_max = max(len(r.prompt_ids) for r in rollouts)
    c_max = max(max(len(r.completion_ids) for r in rollouts), 1)
    b = len(rollouts)
    input_ids = torch.full((b, p_max + c_max), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p_max + c_max), dtype=torch.long)
    completion_mask = torch.zeros((b, c_max), dtype=torch.float32)
    gen_logprobs = torch.zeros((b, c_max), dtype=torch.float32)
    for row, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[row, p_max - p : p_max] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attention_mask[row, p_max - p : p_max + c] = 1
        if c:
            input_ids[row, p_max : p_max + c] = torch.tensor(r.completion_ids, dtype=torch.long)
            gen_logprobs[row, :c] = torch.tensor(r.gen_logprobs, dtype=torch.float32)
            completion_mask[row, min(r.branch_point, c) : c] = 1.0
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        gen_logprobs=gen_logprobs,
        advantages=torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
        rewards=torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        group_ids=torch.tensor([r.group_id for r in rollouts], dtype=torch.long),
        branch_points=torch.tensor([r.branch_point for r in rollouts], dtype=torch.long),
        prompt_len=p_max,
    )


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:  # [B, T] -> [B, T]
    """Positions that count only real tokens, as HF `generate` assigns them under left padding.

    Without this a left-padded row would see its first real token at position `pad_count`, not 0, and the
    trainer's log-probs would differ from the generator's.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
