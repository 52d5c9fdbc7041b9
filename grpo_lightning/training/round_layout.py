"""A round's rollouts laid out for training: micro-batches of whole advantage groups, the order of the passes, and
each optimizer step's trained tokens over all ranks (the rollout loop, rollout_loop.py, calls these)."""

from __future__ import annotations

import dataclasses

import torch

from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.data.datamodule import DataSettings
from grpo_lightning.distributed import sum_across_ranks
from grpo_lightning.types import Rollout, RolloutBatch, Round


def micro_batches_of(rollouts: list[Rollout], groups_per_micro_batch: int, pad_token_id: int) -> list[RolloutBatch]:
    """Collate the round's rollouts into micro-batches of `groups_per_micro_batch` whole advantage groups."""
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    group_list = list(groups.values())
    if len(group_list) % groups_per_micro_batch:
        raise ValueError(
            f"the round has {len(group_list)} groups, not a multiple of data.groups_per_micro_batch "
            f"({groups_per_micro_batch})"
        )
    k = groups_per_micro_batch
    return [
        collate_rollouts([r for g in group_list[i : i + k] for r in g], pad_token_id)
        for i in range(0, len(group_list), k)
    ]


def pass_order(num_micro_batches: int, num_iterations: int, seed: int, round_index: int) -> list[int]:
    """Micro-batch indices in training order: pass 0 in order, later passes shuffled (seeded by round and pass)."""
    order: list[int] = []
    for it in range(num_iterations):
        ids = list(range(num_micro_batches))
        if it > 0:
            gen = torch.Generator().manual_seed(seed * 7919 + round_index * 31 + it)
            ids = torch.randperm(len(ids), generator=gen).tolist()
        order.extend(ids)
    return order


def step_schedule(micro_batches: list[RolloutBatch], order: list[int], accumulate: int) -> list[RolloutBatch]:
    """The micro-batches in `order`, each told the trained tokens (or moves, `RolloutBatch.trained_units`) of its
    optimizer step summed over all ranks (a collective: every rank calls it with the same number of steps)."""
    steps = [order[start : start + accumulate] for start in range(0, len(order), accumulate)]
    local = torch.tensor(  # [num_steps] trained tokens (or moves) of each optimizer step on this rank
        [sum(micro_batches[i].trained_units for i in step) for step in steps],
        dtype=torch.float64,
    )
    tokens = sum_across_ranks(local).tolist()  # step-normalised loss types: the whole step, all ranks
    return [
        dataclasses.replace(micro_batches[i], num_tokens_in_step=n)
        for step, n in zip(steps, tokens, strict=True)
        for i in step
    ]


def round_of(
    round_index: int, rollouts: list[Rollout], micro_batches: list[RolloutBatch], accumulate: int, data: DataSettings
) -> Round:
    """The `Round` the data module serves: the micro-batches in pass order (`data.num_iterations` passes, shuffled
    from `data.seed`), each with its optimizer step's tokens."""
    order = pass_order(len(micro_batches), data.num_iterations, data.seed, round_index)
    schedule = step_schedule(micro_batches, order, accumulate)
    return Round(round_index, tuple(rollouts), tuple(micro_batches), tuple(schedule))


def lay_out(rollouts: list[Rollout], round_index: int, accumulate: int, data: DataSettings, pad_token_id: int) -> Round:
    """A round laid out without a trainer and without old log-probs (benchmarks and tests drive rounds by hand;
    the rollout loop scores old log-probs between the two steps)."""
    micro_batches = micro_batches_of(rollouts, data.groups_per_micro_batch, pad_token_id)
    return round_of(round_index, rollouts, micro_batches, accumulate, data)
