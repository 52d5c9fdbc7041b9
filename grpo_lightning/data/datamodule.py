"""The data module: prompts for each round in, micro-batches of that round's rollouts out.

An epoch is one rollout round. The rollout callback asks `prompts_for_round(r)` for the round's prompts, has
the variant turn them into rollouts, and hands them back with `set_rollouts`; `train_dataloader()` (reloaded
every epoch) then serves micro-batches of WHOLE advantage groups, `num_iterations` passes over the round.

Prompt order is a pure function of (seed, round): a seeded permutation of the problems per pass over the data
set, so a resumed run sees the same prompts.

Several processes (DDP): `prompts_per_round` counts the whole round; each rank trains on its contiguous block of
`prompts_per_round / world_size` prompts (the rollout callback shards them), and a `dapo` step's token count is
summed over ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader

from grpo_lightning.data.gsm8k import GSM8K, Problem
from grpo_lightning.distributed import sum_across_ranks
from grpo_lightning.dynamic_sampling import DynamicSampling
from grpo_lightning.rollouts import Rollout, RolloutBatch, collate_rollouts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One problem, chat-formatted and tokenised."""

    prompt_ids: list[int]
    answer: str
    question: str
    problem_index: int
    full_length: int = 0
    """Tokens before cutting to `max_prompt_tokens` (more than len(prompt_ids) when the prompt was cut)."""


def encode_prompt(tokenizer, dataset: GSM8K, problem: Problem, index: int, max_prompt_tokens: int) -> Prompt:
    """Chat-format and tokenise one problem; an over-long prompt keeps its last `max_prompt_tokens` tokens."""
    text = tokenizer.apply_chat_template(dataset.messages(problem.question), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(
        prompt_ids=ids[-max_prompt_tokens:],
        answer=problem.answer,
        question=problem.question,
        problem_index=index,
        full_length=len(ids),
    )


def _identity(batch: RolloutBatch) -> RolloutBatch:
    return batch


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        dataset: GSM8K,
        prompts_per_round: int = 4,
        groups_per_micro_batch: int = 1,
        num_iterations: int = 1,
        max_prompt_tokens: int = 512,
        seed: int = 0,
        tokenizer=None,
        dynamic_sampling: DynamicSampling | None = None,
    ) -> None:
        super().__init__()
        for key, value in [
            ("prompts_per_round", prompts_per_round),
            ("groups_per_micro_batch", groups_per_micro_batch),
            ("num_iterations", num_iterations),
            ("max_prompt_tokens", max_prompt_tokens),
        ]:
            if value < 1:
                raise ValueError(f"data.{key} must be >= 1 (got {value})")
        if prompts_per_round % groups_per_micro_batch:
            raise ValueError(
                f"data.prompts_per_round ({prompts_per_round}) must be a multiple of "
                f"data.groups_per_micro_batch ({groups_per_micro_batch})"
            )
        self.dataset = dataset
        self.prompts_per_round = prompts_per_round
        self.groups_per_micro_batch = groups_per_micro_batch
        self.num_iterations = num_iterations
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.tokenizer = tokenizer
        self.dynamic_sampling = dynamic_sampling or DynamicSampling()
        """Whether rounds drop zero-variance groups and draw fresh prompts (grpo_lightning/dynamic_sampling.py)."""
        self.world_size = 1
        self.problems: list[Problem] = []
        self.micro_batches: list[RolloutBatch] = []
        self.schedule: list[RolloutBatch] = []

    @property
    def micro_batches_per_round(self) -> int:
        """Micro-batches of one round on one process."""
        return self.prompts_per_round // (self.groups_per_micro_batch * self.world_size)

    def set_world_size(self, world_size: int) -> None:
        """Processes the round is split over (from the trainer config, before the processes start)."""
        if self.prompts_per_round % (self.groups_per_micro_batch * world_size):
            raise ValueError(
                f"data.prompts_per_round ({self.prompts_per_round}) must be a multiple of data.groups_per_micro_batch "
                f"({self.groups_per_micro_batch}) x the number of processes ({world_size}, trainer.devices x "
                "trainer.num_nodes)"
            )
        self.world_size = world_size

    def setup(self, stage: str | None = None) -> None:
        if not self.problems:
            self.problems = self.dataset.load()

    # ---- prompts -------------------------------------------------------------------------------------------
    def problem_indices(self, start: int, count: int) -> list[int]:
        """Indices of the problems at positions [start, start + count) of the prompt stream.

        The stream is one seeded permutation of the problems per pass over the data set, concatenated, so any
        position maps to the same problem in every run with this seed (a resumed run included).
        """
        n = len(self.problems)
        permutations: dict[int, list[int]] = {}
        indices = []
        for k in range(start, start + count):
            data_pass, offset = divmod(k, n)
            if data_pass not in permutations:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + data_pass)
                permutations[data_pass] = torch.randperm(n, generator=gen).tolist()
            indices.append(permutations[data_pass][offset])
        return indices

    def problem_indices_for_round(self, round_index: int) -> list[int]:
        """Indices of round `round_index`'s problems when every round takes `prompts_per_round` of the stream."""
        return self.problem_indices(round_index * self.prompts_per_round, self.prompts_per_round)

    def prompts_for_round(self, round_index: int) -> list[Prompt]:
        return self.prompts_at(round_index * self.prompts_per_round, self.prompts_per_round)

    def prompts_at(self, start: int, count: int) -> list[Prompt]:
        """The prompts at stream positions [start, start + count) (dynamic sampling draws past a round's own)."""
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule needs a tokenizer to build prompts")
        prompts = [self.encode(i) for i in self.problem_indices(start, count)]
        cut = [p for p in prompts if p.full_length > len(p.prompt_ids)]
        if cut:  # the start of the prompt (system prompt, question) is gone: the model sees a fragment
            log.warning(
                "%d of %d prompts were longer than data.max_prompt_tokens=%d (up to %d tokens) and lost their first "
                "tokens",
                len(cut),
                len(prompts),
                self.max_prompt_tokens,
                max(p.full_length for p in cut),
            )
        return prompts

    def encode(self, problem_index: int) -> Prompt:
        return encode_prompt(
            self.tokenizer, self.dataset, self.problems[problem_index], problem_index, self.max_prompt_tokens
        )

    # ---- rollouts ------------------------------------------------------------------------------------------
    def set_rollouts(
        self,
        rollouts: list[Rollout],
        round_index: int,
        accumulate_grad_batches: int,
        old_logprob_fn: Callable[[RolloutBatch], torch.Tensor] | None = None,
    ) -> None:
        """Group the round's rollouts into micro-batches and lay out the passes of this round.

        `old_logprob_fn` (given when several optimizer steps consume the round) scores each micro-batch once,
        before any update, and the scores travel with the micro-batch through every pass.
        """
        groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.group_id, []).append(r)
        group_list = list(groups.values())
        if len(group_list) % self.groups_per_micro_batch:
            raise ValueError(
                f"the round has {len(group_list)} groups, not a multiple of data.groups_per_micro_batch "
                f"({self.groups_per_micro_batch})"
            )
        pad_id = self.tokenizer.pad_token_id
        k = self.groups_per_micro_batch
        self.micro_batches = [
            collate_rollouts([r for g in group_list[i : i + k] for r in g], pad_id)
            for i in range(0, len(group_list), k)
        ]
        if old_logprob_fn is not None:
            for mb in self.micro_batches:
                mb.old_logprobs = old_logprob_fn(mb).float().cpu()  # [B, C]
        self.schedule = self._schedule(round_index, accumulate_grad_batches)

    def _schedule(self, round_index: int, accumulate: int) -> list[RolloutBatch]:
        """Pass 0 in order, later passes shuffled (seeded); each entry knows its optimizer step's token count."""
        order: list[int] = []
        for it in range(self.num_iterations):
            ids = list(range(len(self.micro_batches)))
            if it > 0:
                gen = torch.Generator().manual_seed(self.seed * 7919 + round_index * 31 + it)
                ids = torch.randperm(len(ids), generator=gen).tolist()
            order.extend(ids)
        steps = [order[start : start + accumulate] for start in range(0, len(order), accumulate)]
        local = torch.tensor(  # [num_steps] trained tokens of each optimizer step on this rank
            [sum(float(self.micro_batches[i].completion_mask.sum()) for i in step) for step in steps],
            dtype=torch.float64,
        )
        tokens = sum_across_ranks(local).tolist()  # dapo: the whole step, all ranks (docs/algorithm.md)
        return [
            dataclasses.replace(self.micro_batches[i], num_tokens_in_step=n)
            for step, n in zip(steps, tokens, strict=True)
            for i in step
        ]

    def train_dataloader(self) -> DataLoader:
        if not self.schedule:
            raise RuntimeError("no rollouts for this round: the RolloutCallback must run before the data loader")
        return DataLoader(self.schedule, batch_size=None, shuffle=False, collate_fn=_identity)
