"""The data module: the prompt stream in, the micro-batches of the round it is given out.

An epoch is one rollout round. The rollout loop (grpo_lightning/training/rollout_loop.py) asks `prompts_for_round(r)`
for the round's prompts, has the variant turn them into rollouts, lays them out and hands the finished `Round`
over with `serve`; `train_dataloader()` (reloaded every epoch) serves its schedule: micro-batches of WHOLE
advantage groups, `num_iterations` passes over the round. It only serves: it calls nothing back and runs no
collective.

Prompt order is a pure function of (seed, round): a seeded permutation of the problems per pass over the data
set, so a resumed run sees the same prompts.

Several processes (DDP): `prompts_per_round` counts the whole round; each rank trains on its contiguous block of
`prompts_per_round / world_size` prompts (the rollout loop shards them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader

from grpo_lightning.algorithm.dynamic_sampling import DynamicSampling
from grpo_lightning.data.source import DataSource, Problem
from grpo_lightning.schema import Configured, check_settings, integer, setting
from grpo_lightning.types import Prompt, RolloutBatch, Round

log = logging.getLogger(__name__)


def encode_prompt(tokenizer, dataset: DataSource, problem: Problem, index: int, max_prompt_tokens: int) -> Prompt:
    """Chat-format and tokenise one problem; an over-long prompt keeps its last `max_prompt_tokens` tokens.

    `dataset` is any data source (data/source.py); the problem's `record` travels with the prompt."""
    text = tokenizer.apply_chat_template(dataset.messages(problem.question), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(
        prompt_ids=ids[-max_prompt_tokens:],
        answer=problem.answer,
        question=problem.question,
        problem_index=index,
        full_length=len(ids),
        record=problem.record,
    )


def _identity(batch: RolloutBatch) -> RolloutBatch:
    return batch


@dataclass(frozen=True)
class DataSettings:
    """`data`: the round's size and layout (the dataset and dynamic sampling are nodes of their own)."""

    prompts_per_round: int = setting(2, integer(1))
    groups_per_micro_batch: int = setting(1, integer(1))
    num_iterations: int = setting(1, integer(1))
    max_prompt_tokens: int = setting(512, integer(1))
    seed: int = setting(0, integer(0))

    def __post_init__(self) -> None:
        check_settings(self, "data")

    @staticmethod
    def joint_problems(values: dict, prefix: str) -> list[str]:
        """A round splits into whole micro-batches."""
        prompts, groups = values.get("prompts_per_round"), values.get("groups_per_micro_batch")
        if prompts is not None and groups is not None and prompts % groups:
            multiple = f"must be a multiple of {prefix}.groups_per_micro_batch ({groups})"
            return [f"{prefix}.prompts_per_round ({prompts}) {multiple}"]
        return []


class RolloutDataModule(Configured, L.LightningDataModule):
    settings_types = (DataSettings,)

    def __init__(
        self, dataset: DataSource, dynamic_sampling: DynamicSampling | None = None, world_size: int = 1, **keys
    ) -> None:
        """`dataset`: the data source (`data.dataset`), a `DataSource`: one that is not is refused here, when the
        run is built, rather than when a caller first asks it what it has not said. `keys`: the `data` node's own
        (`DataSettings`). `world_size`: the processes a round is split over (trainer.devices x trainer.num_nodes,
        known from the config before any process starts)."""
        super().__init__()
        if not isinstance(dataset, DataSource):
            raise ValueError(
                f"data.dataset._target_: {type(dataset).__qualname__} is not a data source: derive it from "
                "grpo_lightning.data.source.DataSource (docs/extending.md, Adding a data source)"
            )
        (self.settings,) = self.settings_from(keys)
        per_micro_batch = self.settings.groups_per_micro_batch * world_size
        if self.settings.prompts_per_round % per_micro_batch:
            raise ValueError(
                f"data.prompts_per_round ({self.settings.prompts_per_round}) must be a multiple of "
                f"data.groups_per_micro_batch ({self.settings.groups_per_micro_batch}) x the number of processes "
                f"({world_size}, trainer.devices x trainer.num_nodes)"
            )
        self.dataset = dataset
        self.dynamic_sampling = dynamic_sampling or DynamicSampling()
        """Whether rounds drop zero-variance groups and draw fresh prompts (algorithm/dynamic_sampling.py)."""
        self.world_size = world_size
        self.problems: list[Problem] = []
        self.round: Round | None = None
        """The round being served (grpo_lightning/training/rollout_loop.py builds it)."""

    @property
    def micro_batches_per_round(self) -> int:
        """Micro-batches of one round on one process."""
        return self.settings.prompts_per_round // (self.settings.groups_per_micro_batch * self.world_size)

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
                gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + data_pass)
                permutations[data_pass] = torch.randperm(n, generator=gen).tolist()
            indices.append(permutations[data_pass][offset])
        return indices

    def problem_indices_for_round(self, round_index: int) -> list[int]:
        """Indices of round `round_index`'s problems when every round takes `prompts_per_round` of the stream."""
        return self.problem_indices(round_index * self.settings.prompts_per_round, self.settings.prompts_per_round)

    def prompts_for_round(self, round_index: int, tokenizer) -> list[Prompt]:
        return self.prompts_at(
            round_index * self.settings.prompts_per_round, self.settings.prompts_per_round, tokenizer
        )

    def prompts_at(self, start: int, count: int, tokenizer) -> list[Prompt]:
        """The prompts at stream positions [start, start + count) (dynamic sampling draws past a round's own),
        chat-formatted and tokenised with the policy's `tokenizer`."""
        prompts = [self.encode(i, tokenizer) for i in self.problem_indices(start, count)]
        cut = [p for p in prompts if p.full_length > len(p.prompt_ids)]
        if cut:  # the start of the prompt (system prompt, question) is gone: the model sees a fragment
            log.warning(
                "%d of %d prompts were longer than data.max_prompt_tokens=%d (up to %d tokens) and lost their first "
                "tokens",
                len(cut),
                len(prompts),
                self.settings.max_prompt_tokens,
                max(p.full_length for p in cut),
            )
        return prompts

    def encode(self, problem_index: int, tokenizer) -> Prompt:
        problem = self.problems[problem_index]
        return encode_prompt(tokenizer, self.dataset, problem, problem_index, self.settings.max_prompt_tokens)

    # ---- the round it serves -------------------------------------------------------------------------------
    def serve(self, round_: Round) -> None:
        """Serve this round from the next data loader on (the rollout loop built it; nothing here changes it)."""
        self.round = round_

    @property
    def micro_batches(self) -> tuple[RolloutBatch, ...]:
        return self.round.micro_batches if self.round is not None else ()

    @property
    def schedule(self) -> tuple[RolloutBatch, ...]:
        return self.round.schedule if self.round is not None else ()

    def train_dataloader(self) -> DataLoader:
        if not self.schedule:
            raise RuntimeError("no rollouts for this round: the rollout loop must serve one before the data loader")
        return DataLoader(list(self.schedule), batch_size=None, shuffle=False, collate_fn=_identity)
