"""Rollouts from a Hugging Face model: the CPU engine, and the reference for every other engine.

`HFEngine` is the sampling both HF engines share: the one the rollout loop drives, which samples from the policy
object itself (LoRA adapters active; `HFGenerator`, generation/hf.py), and its copy that samples from a snapshot of
the policy beside the trainer (`SnapshotHFGenerator`, generation/hf_snapshot.py). How it samples is set by one
`GenerationSettings` (`perf.generate`, grpo_lightning/accel/): by default our own decode loop
(accel/decode_loop.py: pre-allocated KV cache, O(V) sampler); `perf.generate.custom_decode=false` calls HF
`generate`. Log-probs are taken from the raw logits as log_softmax(logits / temperature), the same
distribution the trainer scores (TRL divides logits by the temperature too). With top_p < 1 or top_k > 0
they are those of the truncated, renormalised distribution the tokens were drawn from, which the trainer
replays (algorithm/truncation.py).
With `perf.generate.weights=bfloat16 | int8` the linear layers sample through low-precision copies of their
weights (accel/low_precision.py) and the log-probs are that forward's; the rollout correction then turns on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.decode_loop import attention_backends_for_decoding, new_cache, sample_loop
from grpo_lightning.accel.generation_levers import StepLogprobRecorder, merged_lora, shared_prefill
from grpo_lightning.accel.graph_decode import StaticSteps
from grpo_lightning.accel.head_input import restrided_head_input
from grpo_lightning.accel.heap_trim import release_freed_memory
from grpo_lightning.accel.low_precision import low_precision_linears
from grpo_lightning.accel.packed_weights import packed_linears
from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.distributed import derive_seed
from grpo_lightning.generation.base import Generator, SamplingConfig, eos_token_ids, truncate
from grpo_lightning.generation.stale_guard import ACTION_RULE, THRESHOLD_RULE, StaleWeightGuard
from grpo_lightning.schema import boolean, check_settings, integer, setting
from grpo_lightning.sharding import gathered_for_sampling
from grpo_lightning.types import Completion


def rows_or_auto(value) -> str | None:
    """generator.batch_size's rule: a row count >= 1, or `auto`."""
    return None if value == "auto" or integer(1)(value) is None else "must be an integer >= 1 or auto"


CPU_AUTO_ROWS = 16
"""generator.batch_size=auto on a CPU: sequences per generate call. A CPU decode step reads every weight once
whatever the row count while its time grows with the rows; 16 is what the CPU rounds are measured with
(benchmarks/README.md). A run passes the plan's rows (app/memory.py `decode_rows`); an engine built outside a run
reads this."""


@dataclass(frozen=True)
class HFSettings:
    """The Hugging Face engine's own keys (generator=hf); the sampling keys are `SamplingConfig`'s, the speed
    levers `perf.generate`'s."""

    batch_size: int | str = setting("auto", rows_or_auto)
    seed_per_prefix: bool = setting(False, boolean)
    logp_diff_threshold: float | None = setting(0.1, THRESHOLD_RULE)
    on_stale: str = setting("warn", ACTION_RULE)

    def __post_init__(self) -> None:
        check_settings(self, "generator")


@dataclass(frozen=True)
class DecodeCall:
    """One generate call of the engine: left-padded prefixes, samples per prefix and the new tokens at most."""

    input_ids: torch.Tensor  # [n, L]
    attention_mask: torch.Tensor  # [n, L]
    num_samples: int
    max_new_tokens: int
    greedy: bool
    share_prefill: bool
    """Run each prefix once and its samples on top of its KV cache (`perf.generate.share_prefill`)."""


class HFEngine(Generator):
    """Batched sampling from a Hugging Face model with left padding: our decode loop, or `model.generate`."""

    settings_types = (SamplingConfig, HFSettings)
    memory_kind = "hf"
    settings: HFSettings
    """The engine's own keys (`generator.batch_size`, `seed_per_prefix`, the stale-weight guard's)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        generation_settings: GenerationSettings | None = None,
        trainer_devices: Sequence[int] = (),
        **keys,
    ) -> None:
        """`keys`: the `generator` node's (`SamplingConfig`, `HFSettings`). `trainer_devices` (the trainer's CUDA
        indices, given to every engine by train.py) is unused here: this engine samples from the model it is
        given, on whatever device the trainer put it."""
        self.sampling, self.settings = self.settings_from(keys)
        # The engine samples from the policy itself (no sync), so the guard only flags trainer / generator
        # disagreement from precision or dropout.
        self.guard = StaleWeightGuard(self.settings.logp_diff_threshold, self.settings.on_stale)
        self.callbacks: list = []  # Lightning callbacks the trainer adds (train.py): none for this engine
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. to the EOS token) in the model config")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = self.settings.batch_size
        """Sequences per generate call: `generator.batch_size`, or what `rows_per_call` sets for a while."""
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        # Speed / memory levers (grpo_lightning/accel/), each equal to the plain path up to float rounding.
        self.generation_settings = generation_settings if generation_settings is not None else GenerationSettings()
        self.round_seed = 0
        self.draws: torch.Generator | None = None
        """Where the decode loop draws its random numbers; None: the global RNG (this engine). The copy that samples
        beside the trainer (hf_snapshot.py) draws from generators of its own."""

    def reseed(self, round_seed: int) -> None:
        """Base of the per-prefix seeds (the rollout loop passes one derived from (seed, round))."""
        self.round_seed = round_seed

    @contextlib.contextmanager
    def sampling_session(self) -> Iterator[None]:
        """trainer=fsdp: the policy's shards gathered for the block, so that no decode step needs a collective
        (ranks decode different numbers of steps); nothing to do for a policy that is not sharded."""
        with gathered_for_sampling(self.model):
            yield

    @contextlib.contextmanager
    def rows_per_call(self, rows: int) -> Iterator[None]:
        """`batch_size = rows` while the block runs. Greedy decoding of many short prompts (the evaluator) is
        cheaper per problem in one wide call than in several narrow ones on CPU, where every decode step reads
        all the weights once whatever the row count."""
        previous, self.batch_size = self.batch_size, rows
        try:
            yield
        finally:
            self.batch_size = previous

    def rows_per_call_now(self) -> int:
        """Sequences per generate call: `batch_size`, or for `auto` (an engine built outside a run, which gets the
        plan's number) 16 on a CPU and no limit on a GPU."""
        if self.batch_size != "auto":
            return self.batch_size
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        return CPU_AUTO_ROWS if on_cpu else 2**31 - 1

    def _sampling_rng(self, prefix: list[int]):
        """With `seed_per_prefix`, a forked RNG seeded from (round seed, prefix tokens); else the global RNG."""
        if not self.settings.seed_per_prefix:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(derive_seed(self.round_seed, *prefix))
        return stack

    @torch.inference_mode()
    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        # Prefixes with similar budgets share a generate call (stable sort: equal budgets keep their order).
        order = sorted(range(len(prefixes)), key=lambda i: -budgets[i])
        prefixes_per_call = 1 if self.settings.seed_per_prefix else max(1, self.rows_per_call_now() // num_samples)
        was_training = self.model.training
        self.model.eval()
        try:
            results: list[list[Completion]] = [[] for _ in prefixes]
            with self._decode_weights():
                for start in range(0, len(order), prefixes_per_call):
                    chunk = order[start : start + prefixes_per_call]
                    chunk_budget = max(budgets[i] for i in chunk)
                    with self._sampling_rng(prefixes[chunk[0]]):
                        outputs = self._generate_chunk([prefixes[i] for i in chunk], num_samples, chunk_budget, greedy)
                    for i, completions in zip(chunk, outputs, strict=True):
                        results[i] = [truncate(c, budgets[i]) for c in completions]
            return results
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def _decode_weights(self) -> Iterator[None]:
        """The weights a generate call samples with, made once per call: LoRA merged into temporary weights
        (`merge_lora`), then the linear layers' low-precision copies of them (`weights`; accel/low_precision.py);
        and the LM head's input re-laid where its slice would copy the head per row (accel/head_input.py).

        The copies are handed back to the operating system when the call ends (`release_freed_memory`): glibc
        keeps the freed blocks, scattered among live ones, so without it the process stays near the call's peak
        and the training phase's memory adds on top (a bf16 Qwen2.5-1.5B on a CPU: 3.3 GiB resident before three
        calls with LoRA merged, 6.0 GiB after them; with it 3.3 GiB)."""
        levers = self.generation_settings
        with (
            merged_lora(self.model) if levers.merge_lora else contextlib.nullcontext() as merged,
            low_precision_linears(self.model, levers.weights) as low_precision_layers,
            restrided_head_input(self.model),  # half precision on a CPU: no copy of the head per row
        ):
            yield
        if merged or low_precision_layers:
            release_freed_memory()

    def _generate_chunk(
        self, prefixes: list[list[int]], num_samples: int, max_new_tokens: int, greedy: bool = False
    ) -> list[list[Completion]]:
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_pad(prefixes, self.tokenizer.pad_token_id)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        levers = self.generation_settings
        share = levers.share_prefill and num_samples > 1 and input_ids.shape[1] > 1
        call = DecodeCall(input_ids, attention_mask, num_samples, max_new_tokens, greedy, share)
        sample = self._sample_with_loop if levers.custom_decode else self._sample_with_generate
        rows = input_ids.shape[0] * num_samples
        packing = levers.packed_weights if levers.weights == "float32" else False  # MKL packs float32 weights only
        with packed_linears(self.model, rows, packing), attention_backends_for_decoding(device):
            tokens, logprobs = sample(call)
        completions = [self._trim(tokens[row], logprobs[row]) for row in range(tokens.shape[0])]
        return [completions[i * num_samples : (i + 1) * num_samples] for i in range(len(prefixes))]

    def _sample_with_loop(
        self, call: DecodeCall
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens, log-probs [n * K, T_new]
        """Our own loop (accel/decode_loop.py); on CUDA its decode steps replayed from CUDA graphs
        (`perf.generate.cuda_graphs`, accel/graph_decode.py)."""
        cache = new_cache(self.model, call.input_ids.shape[1] + call.max_new_tokens)
        if call.share_prefill:
            ids, mask, cache = shared_prefill(self.model, call.input_ids, call.attention_mask, call.num_samples, cache)
        else:
            ids = call.input_ids.repeat_interleave(call.num_samples, 0)  # [n * K, L]
            mask = call.attention_mask.repeat_interleave(call.num_samples, 0)
        steps = None
        if self.generation_settings.cuda_graphs and ids.is_cuda:
            steps = StaticSteps(self.model, cache, mask, call.max_new_tokens, capture=True)
        return sample_loop(
            self.model,
            ids,
            mask,
            cache,
            call.max_new_tokens,
            self.eos_token_ids,
            self.tokenizer.pad_token_id,
            self.sampling.temperature,
            self.sampling.top_k,
            self.sampling.top_p,
            greedy=call.greedy,
            sampler=self.generation_settings.sampler,
            rng=self.draws,
            steps=steps,
        )

    def _sample_with_generate(self, call: DecodeCall) -> tuple[torch.Tensor, torch.Tensor]:  # [n * K, T_new] x 2
        """HF `generate` (`perf.generate.custom_decode=false`)."""
        stream_logprobs = self.generation_settings.stream_logprobs
        sampling = {
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
        }
        config = GenerationConfig(
            do_sample=not call.greedy,
            **({} if call.greedy else sampling),
            max_new_tokens=call.max_new_tokens,
            num_return_sequences=call.num_samples,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.eos_token_ids,
            output_logits=not stream_logprobs,
            return_dict_in_generate=True,
        )
        inputs = {"input_ids": call.input_ids, "attention_mask": call.attention_mask}
        if call.share_prefill:
            ids, mask, cache = shared_prefill(self.model, call.input_ids, call.attention_mask, call.num_samples)
            inputs = {"input_ids": ids, "attention_mask": mask, "past_key_values": cache}
            config.num_return_sequences = 1
        truncation = Truncation() if call.greedy else Truncation(self.sampling.top_k, self.sampling.top_p)
        recorder = StepLogprobRecorder(self.model, self.sampling.temperature, truncation)
        with recorder if stream_logprobs else contextlib.nullcontext():
            out = self.model.generate(**inputs, generation_config=config)
        new_tokens = out.sequences[:, call.input_ids.shape[1] :].cpu()  # [n * K, T_new]
        if not stream_logprobs:
            return new_tokens, sampled_logprobs(out.logits, new_tokens, self.sampling.temperature, truncation)
        if not new_tokens.shape[1]:
            return new_tokens, torch.zeros(len(new_tokens), 0)
        return new_tokens, recorder.finish(new_tokens[:, -1])

    def _trim(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> Completion:  # [T_new], [T_new]
        """Cut a generated row after its first EOS (what follows is padding)."""
        ids = tokens.tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_token_ids), None)
        length = end if end is not None else len(ids)
        return Completion(ids[:length], logprobs[:length].tolist(), finished=end is not None)


def left_pad(prefixes: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists: returns input_ids [n, L] and attention_mask [n, L]."""
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("cannot generate from an empty prefix")
    width = max(len(p) for p in prefixes)
    input_ids = torch.full((len(prefixes), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for row, p in enumerate(prefixes):
        input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[row, width - len(p) :] = 1
    return input_ids, attention_mask


def sampled_logprobs(
    step_logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float, truncation: Truncation
) -> torch.Tensor:
    """Log-prob of each sampled token under softmax(logits / temperature) over the tokens `truncation` keeps.

    step_logits: T_new tensors of [N, V] raw logits (one per generation step); tokens: [N, T_new].
    Returns [N, T_new] float32. Works step by step so no [N, T_new, V] tensor is built.
    """
    columns = []
    for t, logits in enumerate(step_logits):
        logp = truncation.log_probs(logits.float().cpu() / temperature, tokens[:, t])  # [N]
        columns.append(logp.unsqueeze(-1))  # [N, 1]
    return torch.cat(columns, dim=-1) if columns else torch.zeros(tokens.shape[0], 0)
