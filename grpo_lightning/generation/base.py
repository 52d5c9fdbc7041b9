"""The generator base class every rollout engine derives from.

A generator samples completions from token-id prefixes. A prefix is usually a chat-formatted prompt; a
variant that branches (STORPO) passes `prompt_ids + completion_ids[:k]` instead, so continuation is the same
call. Engines return token ids and the per-token log-probs of their own sampling distribution, which the
trainer compares against its own (`rollout/logp_diff_*`) to catch stale weights.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.schema import Configured, check_settings, integer, number, setting
from grpo_lightning.types import Completion

if TYPE_CHECKING:
    import lightning as L
    from transformers import PreTrainedTokenizerBase

MIN_TEMPERATURE = 1e-3
"""Below this, logits / temperature overflow float16 (max 65504) for logits above 65, and the sampled-token
log-probs lose all precision; sampling is greedy decoding anyway (which evaluation already does)."""
LOW_TEMPERATURE = 0.1
"""Below this a group's G samples are nearly identical: most advantages are 0 and the round trains little."""


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters shared by every engine (config group `generator`). How many completions a prefix gets is
    the caller's (`generate(prefixes, num_samples, ...)`): the variant owns the group's size."""

    max_new_tokens: int = setting(96, integer(1))
    temperature: float = setting(0.7, number(above=0))
    top_p: float = setting(1.0, number(above=0, high=1))
    top_k: int = setting(0, integer(0))

    def __post_init__(self) -> None:
        check_settings(self, "generator")


class Generator(Configured, ABC):
    """What the rollout loop, the variants and the evaluator need from an engine; every engine derives from it.

    An abstract base class rather than a Protocol: the optional parts (`reseed`, `push_weights`,
    `rows_per_call`) have a default here, so callers call them on every engine instead of asking whether an
    engine has them, and a new engine states in one place what it does differently. An engine is `Configured`:
    its `settings_types` declare the keys of its `generator` node (`SamplingConfig`'s and its own).
    """

    memory_kind: ClassVar[str] = "remote"
    """Where sampling takes memory, for the plan's estimate (app/memory.py): 'hf' (our decode loop in the
    trainer's process: KV cache and step logits), 'vllm' (a vLLM engine in or beside the trainer's process), or
    'remote' (another machine's or process's budget: a `vllm serve` server)."""
    overlaps_sharded_training: ClassVar[bool] = False
    """Whether the engine samples the next round beside `trainer=fsdp` training (`rollout.max_staleness` >= 1):
    true where it holds weights of its own, pushed on the trainer's thread at a round's start (servers); false
    where it would sample from a copy of the policy, which sharding splits between the processes."""
    sampling: SamplingConfig
    """The sampling parameters (config group `generator`); variants read `sampling.max_new_tokens`."""
    guard: StaleWeightGuard
    """The engine's stale-weight guard, told of every round by the rollout loop (generation/stale_guard.py)."""
    callbacks: list[L.Callback]
    """Lightning callbacks the engine needs beside the rollout loop (train.py adds them to the trainer)."""

    def generate(
        self,
        prefixes: list[list[int]],
        num_samples: int,
        max_new_tokens: int | Sequence[int] | None = None,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        """Sample `num_samples` completions for each token-id prefix; result[i][j] is sample j of prefix i.

        `max_new_tokens` defaults to `sampling.max_new_tokens`; a branching variant passes the budget left,
        one int for all prefixes or one per prefix. `greedy=True` decodes argmax tokens (evaluation; then
        `num_samples` must be 1). Every engine checks a request alike, then samples it (`sample`).
        """
        budgets = request_budgets(self.sampling, len(prefixes), num_samples, max_new_tokens, greedy)
        return self.sample(prefixes, num_samples, budgets, greedy)

    @abstractmethod
    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        """`generate` once its request is checked: at most `budgets[i]` (>= 1) new tokens for prefix i."""

    @abstractmethod
    def sync_weights(self, policy: nn.Module) -> None:
        """Make the engine sample from the policy's current weights (the rollout loop, before every round)."""

    def reseed(self, round_seed: int) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Take the seed of the round about to be sampled (the rollout loop derives it from (seed, round)).

        No-op: an engine that draws from the global RNG needs no seed of its own; one that seeds each prefix
        (HF with `seed_per_prefix`) keeps it."""

    def push_weights(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Copy the policy's current weights into the engine now, outside the round's `sync_weights` (the
        rollout loop, before an evaluation that follows the last round).

        No-op: an engine that samples from the policy module itself holds no copy to refresh."""

    def engine_metrics(self) -> dict[str, float]:
        """What the engine observed since the last call, logged with the round's metrics (the rollout loop, once a
        round; every process's merged by name).

        Empty: an engine in this process has nothing to report beyond the round's own metrics. A server pool
        reports each server's load (generation/vllm/server_pool.py)."""
        return {}

    def background_copy(self) -> BackgroundEngine:
        """An engine that samples from a snapshot of the policy's weights beside the trainer
        (`rollout.max_staleness` >= 1, training/overlap.py).

        Default: this engine cannot (one line naming the key)."""
        raise ValueError(
            f"rollout.max_staleness >= 1 samples the next round beside the trainer, which {type(self).__name__} "
            "cannot do yet; set rollout.max_staleness=0 or use generator=hf"
        )

    def close(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Release what the engine holds outside this process when the run ends (Run.fit): servers it started.

        No-op: an engine in this process (or in a child that ends with it) holds nothing beyond it."""

    @contextlib.contextmanager
    def sampling_session(self) -> Iterator[None]:
        """A block every training process enters together (a round's sampling, an evaluation), around any number
        of `generate` calls, which may differ between processes.

        No-op: an engine that holds its own weights needs nothing from the other processes while it samples. The
        HF engine on a sharded policy (trainer=fsdp) gathers the policy for the block (grpo_lightning/sharding.py)."""
        yield

    @contextlib.contextmanager
    def rows_per_call(self, rows: int) -> Iterator[None]:
        """Decode up to `rows` rows per call while the block runs (the evaluator: many short greedy prompts).

        No-op: an engine that schedules its own batches (vLLM) has no row count to set."""
        yield


class SamplingCancelled(Exception):
    """The run stopped while a round was being sampled beside the trainer (that round is dropped)."""


class BackgroundEngine(Generator):
    """An engine copy that samples beside the trainer (`Generator.background_copy`; docs/overlap.md).

    `sync_weights(policy)` copies the policy's current weights into the copy (the trainer then goes on changing
    the policy; the copy keeps what it got), `reseed` seeds random streams of the copy's own (it never draws from
    the global RNG, which the trainer's thread owns), and a checkpoint keeps the snapshot (`weights`) when no
    sampled round goes with it, so a resumed run samples that round again from the same weights.
    """

    cancel: threading.Event
    """Set when the run stops: the copy's next generate call raises `SamplingCancelled`."""

    def use_threads(self, threads: int) -> None:
        """Sample with `threads` CPU threads while beside the trainer (called in the worker thread). Default: this
        thread's count, which torch keeps per thread (OpenMP's count and MKL's local one); an engine in another
        process sets that process's.

        A thread's first parallel op initialises its count from the count last set by any thread
        (`at::internal::lazy_init_num_threads`). Reading the count first runs that initialisation now, so a count
        the trainer sets later cannot replace this one mid-round and change the sampler's float rounding."""
        torch.get_num_threads()
        torch.set_num_threads(threads)

    def push_in_flight(self, policy: nn.Module) -> bool:
        """After an optimizer step that is not the round's last, while a round is sampled from the copy: give the
        copy the policy's weights now, without stopping that round, and say whether it did. Default: it does not;
        the copy samples the whole round from the weights of the round's start (reproducible). Servers do with
        `generator.push_in_flight` (docs/overlap.md)."""
        return False

    @abstractmethod
    def weights(self) -> dict[str, Tensor]:
        """The snapshot's trainable weights by parameter name (CPU copies), for a checkpoint."""

    @abstractmethod
    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """`weights()` of an earlier run back into the snapshot (checked first with `check_saved_weights`)."""


def check_saved_weights(trainable: Iterable[str], weights: dict[str, Tensor]) -> None:
    """A checkpoint's sampler snapshot must hold exactly the trainable parameters of this run's policy: one line
    naming the first that differs (a checkpoint of another model or adapter), before anything is copied."""
    names = set(trainable)
    missing, unknown = sorted(names - weights.keys()), sorted(weights.keys() - names)
    if missing:
        raise ValueError(f"ckpt_path: the checkpoint's sampler weights lack {missing[0]} (another model?)")
    if unknown:
        raise ValueError(
            f"ckpt_path: the checkpoint's sampler weights hold {unknown[0]}, which this run does not train "
            "(another model or adapter?)"
        )


def per_prefix_budgets(max_new_tokens: int | Sequence[int] | None, default: int, num_prefixes: int) -> list[int]:
    """Normalise the `max_new_tokens` argument of `Generator.generate` to one budget (>= 1) per prefix."""
    if max_new_tokens is None:
        budgets = [default] * num_prefixes
    elif isinstance(max_new_tokens, int):
        budgets = [max_new_tokens] * num_prefixes
    else:
        budgets = [int(b) for b in max_new_tokens]
    if len(budgets) != num_prefixes:
        raise ValueError(f"got {len(budgets)} max_new_tokens budgets for {num_prefixes} prefixes")
    if any(b < 1 for b in budgets):
        raise ValueError(f"every max_new_tokens budget must be >= 1 (got {min(budgets)})")
    return budgets


def request_budgets(
    sampling: SamplingConfig,
    num_prefixes: int,
    num_samples: int,
    max_new_tokens: int | Sequence[int] | None,
    greedy: bool,
) -> list[int]:
    """Check a `Generator.generate` request (one greedy sample per prefix) and return each prefix's budget."""
    if greedy and num_samples != 1:
        raise ValueError(f"greedy decoding gives one completion per prefix (asked for {num_samples})")
    return per_prefix_budgets(max_new_tokens, sampling.max_new_tokens, num_prefixes)


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models often add <|im_end|>)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    cfg_eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif cfg_eos:
        ids.update(int(i) for i in cfg_eos)
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation config defines an EOS token")
    return sorted(ids)


def truncate(completion: Completion, budget: int) -> Completion:
    """Cut a completion to `budget` tokens; a cut completion is unfinished (truncated)."""
    if len(completion.token_ids) <= budget:
        return completion
    return Completion(completion.token_ids[:budget], completion.logprobs[:budget], finished=False)
