"""Rollout data types: one sampled completion (`Rollout`) and padded tensor batches of them (`RolloutBatch`).

A rollout round is a list of `Rollout`s produced by a variant. The data module collates micro-batches of whole
advantage groups into `RolloutBatch`es; the training step consumes them. Prompts are LEFT-padded and completions
RIGHT-padded (TRL's layout), so every completion starts at the same column `prompt_len` and the completion
log-probs of the whole batch are one `[B, C]` slice of the logits.

Pure: imports neither Lightning nor Hydra.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_lightning.types import MoveRows, Rollout, RolloutBatch


def collate_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> RolloutBatch:
    """Pad a list of rollouts into a `RolloutBatch` (prompts left-padded, completions right-padded).

    `token_advantages` is set only when some rollout carries per-token advantages (STORPO's tree credit); the
    other rows of that batch then hold their scalar advantage on every token, so the loss sees one [B, C] tensor.
    `moves` is set when the rollouts are moves drawn over the legal moves (`Rollout.move_choice`; all or none).
    """
    if not rollouts:
        raise ValueError("collate_rollouts needs at least one rollout")
    p_max = max(len(r.prompt_ids) for r in rollouts)
    c_max = max(max(len(r.completion_ids) for r in rollouts), 1)
    b = len(rollouts)
    input_ids = torch.full((b, p_max + c_max), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p_max + c_max), dtype=torch.long)
    completion_mask = torch.zeros((b, c_max), dtype=torch.float32)
    gen_logprobs = torch.zeros((b, c_max), dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)  # [B]
    per_token = any(r.token_advantages is not None for r in rollouts)
    token_advantages = torch.zeros((b, c_max), dtype=torch.float32) if per_token else None  # [B, C]
    for row, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[row, p_max - p : p_max] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attention_mask[row, p_max - p : p_max + c] = 1
        if c:
            input_ids[row, p_max : p_max + c] = torch.tensor(r.completion_ids, dtype=torch.long)
            gen_logprobs[row, :c] = torch.tensor(r.gen_logprobs, dtype=torch.float32)
            completion_mask[row, min(r.branch_point, c) : c] = 1.0
            if token_advantages is not None:  # a row without its own: its scalar on every token
                row_values = r.token_advantages if r.token_advantages is not None else [r.advantage] * c
                token_advantages[row, :c] = torch.tensor(row_values, dtype=torch.float32)
    moves = _move_rows(rollouts, pad_token_id) if any(r.move_choice is not None for r in rollouts) else None
    return RolloutBatch(
        moves=moves,
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        gen_logprobs=gen_logprobs,
        advantages=advantages,
        rewards=torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
        group_ids=torch.tensor([r.group_id for r in rollouts], dtype=torch.long),
        branch_points=torch.tensor([r.branch_point for r in rollouts], dtype=torch.long),
        prompt_len=p_max,
        token_advantages=token_advantages,
    )


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:  # [B, T] -> [B, T]
    """Positions that count only real tokens, as HF `generate` assigns them under left padding.

    Without this a left-padded row would see its first real token at position `pad_count`, not 0, and the
    trainer's log-probs would differ from the generator's.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _move_rows(rollouts: Sequence[Rollout], pad_token_id: int) -> MoveRows:
    """Every legal move of every rollout as a row of its prompt (rollout by rollout), and the slots that find them."""
    if any(r.move_choice is None for r in rollouts):
        raise ValueError("a batch trains over moves or over tokens: some rollouts have no move_choice")
    choices = [r.move_choice for r in rollouts]
    width = max(len(c.alternatives) for c in choices)
    slots = torch.zeros((len(rollouts), width), dtype=torch.long)  # [B, K]
    slot_mask = torch.zeros((len(rollouts), width), dtype=torch.bool)  # [B, K]
    magnet = torch.zeros((len(rollouts), width), dtype=torch.float32)  # [B, K]
    rows: list[Rollout] = []
    for b, (r, choice) in enumerate(zip(rollouts, choices, strict=True)):
        k = len(choice.alternatives)
        slots[b, :k] = torch.arange(len(rows), len(rows) + k)
        slot_mask[b, :k] = True
        if choice.magnet_logprobs is not None:
            magnet[b, :k] = torch.tensor(choice.magnet_logprobs, dtype=torch.float32)
        rows += [Rollout(r.prompt_ids, list(ids), [0.0] * len(ids), 0.0, b, False) for ids in choice.alternatives]
    with_magnet = [c.magnet_logprobs is not None for c in choices]
    if any(with_magnet) and not all(with_magnet):
        raise ValueError("a batch's moves have a magnet strategy or none: some rollouts have none")
    return MoveRows(
        rows=collate_rollouts(rows, pad_token_id),
        slots=slots,
        slot_mask=slot_mask,
        chosen=torch.tensor([c.chosen for c in choices], dtype=torch.long),
        old_logprobs=torch.tensor([c.logprob for c in choices], dtype=torch.float32),
        magnet_logprobs=magnet if all(with_magnet) else None,
    )
