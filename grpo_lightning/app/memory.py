"""How much memory a run will take, estimated from the config and the model's config.json before anything loads.

A run that cannot fit is refused in one line naming the key to change (`check_fits`), instead of being killed by
the kernel minutes in (exit 137, no message) or dying in a raw CUDA out-of-memory error. The plan (`dry_run=true`
and every run's start) prints the estimate for CPU RAM and, when the trainer or the engine is on CUDA, for GPU
memory. docs/gpu.md (Memory) explains each term.

The estimate is an upper bound of the peak, not a measurement: prompts are counted at `data.max_prompt_tokens`
and completions at `generator.max_new_tokens`. Per token and layer a decoder block keeps about 10 h + 5 i + 2 kv
values for its backward (norm inputs and outputs, q / k / v, the attention output, the MLP's gate, up, activation
and product), where h is the hidden size, i the MLP width and kv the key / value width (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", count the same terms). With
`perf.forward.activation_checkpointing` a layer keeps only its input (h values per token, in the weights' dtype:
the residual stream) and one layer at a time holds the full 10 h + 5 i + 2 kv while it is recomputed. The LM head
adds [tokens, vocab] float32 logits, or one chunk of them with `perf.forward.logits_chunk_tokens`.

Sampling with LoRA merged (`perf.generate.merge_lora`, the HF engine) makes a merged copy of every targeted
linear weight for the length of a generate call: one more copy of most of the weights while sampling.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from grpo_lightning.app.run_shape import RunShape

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROCESS_BASELINE = int(0.75 * GIB)
"""Python, torch, transformers and Lightning in one process (0.4 GiB after the imports, more once running)."""
ROLLOUT_BYTES_PER_TOKEN = 48
"""A rollout's per-token state: ids, masks, log-probs (engine, old, reference) and advantages, in tensors."""
CPU_ENGINE_KV_GIB = 1.0  # generator.kv_cache_gib=null on vLLM's CPU build (generation/vllm/settings.py)
DECODE_STEP_LOGIT_COPIES = 7
"""[rows, vocab] float32 arrays alive at once at the peak of one HF decode step, measured: 7.0x one such array
above the process's level before the call, on the tiny model at 1,024, 2,048 and 4,096 rows (prompts of 6 and 201
tokens; tests/slow/test_memory_bound.py measures it again). The rows of a call are the group's G samples of one
prompt at least, whatever generator.batch_size says."""


GPU_FIT_SHARE = 0.9
"""generator.batch_size=auto on a GPU sizes a call to this share of the GPU's memory: the rest is for the CUDA
context (a few hundred MiB, outside the allocator) and the allocator's fragmentation."""

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS's workspace for each CUDA stream it has run on, kept for the process's life: PyTorch's size on Hopper
(less on older GPUs), measured on an H200 as 32 MiB of allocated memory per stream."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model, read from its config on the meta device (no weights)."""

    parameters: int
    """Unique parameters (a tied LM head counted once)."""
    lora_parameters: int
    """Trainable parameters of the LoRA adapter at model.lora.r on model.lora.target_modules."""
    hidden: int
    intermediate: int
    layers: int
    kv_width: int
    """num_key_value_heads x head_dim."""
    vocab: int
    lora_target_parameters: int
    """Weights of the linear layers the adapter targets: what sampling with LoRA merged copies."""


def model_shape(config, lora_r: int, target_modules: str | list[str]) -> ModelShape:
    """Count the parameters of `config`'s model built on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    config = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings()
    targets = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not output and _targeted(name, target_modules)
    ]
    lora = sum(lora_r * (m.in_features + m.out_features) for m in targets)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        parameters=parameters,
        lora_parameters=lora,
        hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        layers=config.num_hidden_layers,
        kv_width=kv_heads * head_dim,
        vocab=config.vocab_size,
        lora_target_parameters=sum(m.weight.numel() for m in targets),
    )


def _targeted(name: str, target_modules: str | list[str]) -> bool:
    """peft's rule: 'all-linear' takes every linear layer but the output head, a string is a full regex match on
    the module's name, a list matches the name's last component."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, name) is not None
    return name.rsplit(".", 1)[-1] in target_modules


@dataclass(frozen=True)
class Term:
    """One part of the estimate: what it is, its bytes, where it lives and which key makes it smaller."""

    name: str
    bytes: int
    key: str
    """The config key that shrinks this term ('' when no setting does: the process itself)."""


@dataclass
class MemoryEstimate:
    """The peak of each memory, as the sum of the terms that are alive at once."""

    cpu: list[Term] = field(default_factory=list)
    trainer_gpu: list[Term] = field(default_factory=list)
    """One trainer GPU (every DDP rank holds the same); empty when the trainer is on the CPU."""
    engine_gpu: list[Term] = field(default_factory=list)
    """A separate vLLM engine's own GPU (generator.device=cuda:N); empty otherwise."""
    engine_share: float | None = None
    """generator.gpu_memory_utilization where the engine's size is a share of a GPU whose size is not known here."""

    def render(self) -> dict[str, str]:
        lines = {"memory_cpu_ram": _render(self.cpu)}
        if self.trainer_gpu:
            lines["memory_gpu_trainer"] = _render(self.trainer_gpu)
        if self.engine_gpu:
            lines["memory_gpu_engine"] = _render(self.engine_gpu)
        return lines


def _render(terms: list[Term]) -> str:
    total = sum(t.bytes for t in terms)
    parts = ", ".join(f"{t.name} {t.bytes / GIB:.2f}" for t in sorted(terms, key=lambda t: -t.bytes) if t.bytes)
    return f"~{total / GIB:.2f} GiB ({parts})"


def estimate(shape: ModelShape, run: RunShape) -> MemoryEstimate:
    """The peak memory of a run of `run` on a model of `shape` (see the module docstring for the terms)."""
    weight_bytes = DTYPE_BYTES[run.dtype]
    state = _training_state(shape, run)
    activations = _activations(shape, run)
    generation = _generation(shape, run)
    sequence = run.prompt_tokens + run.new_tokens
    rollout_bytes = run.rollouts_per_round * sequence * ROLLOUT_BYTES_PER_TOKEN
    rollouts = Term("rollouts", rollout_bytes, run.heaviest("data.prompts_per_round", *TOKEN_KEYS))
    if run.overlap:  # sampling beside training: both at once, and the sampler's copy of the trainable weights
        state.append(Term("sampler copy", state[-1].bytes // 2, "rollout.max_staleness"))
        peak_work = [activations, *generation]
    else:  # never both at once
        peak_work = [activations] if activations.bytes >= sum(t.bytes for t in generation) else generation

    result = MemoryEstimate()
    process = Term("process", PROCESS_BASELINE, "")
    engine_weights = shape.parameters * DTYPE_BYTES.get(run.engine_dtype, weight_bytes)
    if not run.trainer_on_gpu:
        engine_terms = []
        if run.engine == "vllm" and run.engine_on_cpu:
            kv_gib = CPU_ENGINE_KV_GIB if run.kv_cache_gib is None else run.kv_cache_gib
            engine_terms.append(Term("vLLM engine", engine_weights + int(kv_gib * GIB), "generator.kv_cache_gib"))
        result.cpu = [process, *state, *peak_work, rollouts, *engine_terms]
        return result

    # The trainer is on a GPU: the CPU keeps the process, the rollouts, the model while it loads, and a sleeping
    # engine's weights (sleep level 1 offloads them to CPU memory).
    result.cpu = [process, Term("model while loading", state[0].bytes, "model"), rollouts]
    if run.engine == "vllm" and run.sleep_mode and not run.engine_separate:
        result.cpu.append(Term("sleeping engine's weights", engine_weights, "generator.sleep_level"))
    training = _with_gpu_engine(result, run, state, [*state, *peak_work])
    workspaces = Term("cuBLAS workspaces", run.cuda_streams * CUBLAS_WORKSPACE_BYTES, "")  # no key: a fixed cost
    result.trainer_gpu = [*training, workspaces]
    return result


def _training_state(shape: ModelShape, run: RunShape) -> list[Term]:
    """What training keeps between steps: the weights, a reference copy, the gradients and AdamW's two moments
    (the last term, twice the gradients: the sampler copy of overlapped rounds is half of it)."""
    weight_bytes = DTYPE_BYTES[run.dtype]
    terms = [Term("weights", shape.parameters * weight_bytes, "model")]
    if run.reference_copy:
        terms.append(Term("reference copy", shape.parameters * weight_bytes, "loss.beta"))
    if run.lora:  # peft keeps the adapter in float32 (autocast_adapter_dtype) whatever the base dtype
        trainable, state_bytes, key = shape.lora_parameters, 4, "model.lora.r"
    else:
        trainable, state_bytes, key = shape.parameters, weight_bytes, "model.lora.enabled"
    terms.append(Term("gradients", trainable * state_bytes, key))
    terms.append(Term("optimizer state", 2 * trainable * state_bytes, key))
    return terms


def _activations(shape: ModelShape, run: RunShape) -> Term:
    """One micro-batch's activations kept for the backward, and its LM-head logits."""
    weight_bytes = DTYPE_BYTES[run.dtype]
    act_bytes = 2 if run.mixed_precision or weight_bytes == 2 else 4
    rows = run.groups_per_micro_batch * run.group_size
    if run.share_prefix and run.shared_prompt:  # each prompt runs once, its completions reuse its KV cache
        tokens = run.groups_per_micro_batch * (run.prompt_tokens + run.group_size * run.new_tokens)
    else:
        tokens = rows * (run.prompt_tokens + run.new_tokens)
    per_layer_token = (10 * shape.hidden + 5 * shape.intermediate + 2 * shape.kv_width) * act_bytes
    if run.activation_checkpointing:  # every layer's input, and one layer's activations while it is recomputed
        per_token = shape.layers * shape.hidden * weight_bytes + per_layer_token
    else:
        per_token = shape.layers * per_layer_token
    logit_positions = tokens if run.logits_chunk_tokens is None else min(tokens, run.logits_chunk_tokens)
    logits = logit_positions * shape.vocab * 4 * 3  # float32 logits, their log-softmax and its gradient
    rows_key = "data.groups_per_micro_batch" if run.groups_per_micro_batch > 1 else run.group_key
    return Term("activations", tokens * per_token + logits, run.heaviest(rows_key, *TOKEN_KEYS))


def _generation(shape: ModelShape, run: RunShape) -> list[Term]:
    """The HF engine's widest generate call (KV cache and step logits) and a merged LoRA copy; nothing in this
    process for vLLM or a server."""
    if run.engine != "hf":
        return [Term("generation", 0, "")]
    weight_bytes = DTYPE_BYTES[run.dtype]
    sequence = run.prompt_tokens + run.new_tokens
    kv = run.hf_batch_rows * sequence * 2 * shape.layers * shape.kv_width * weight_bytes
    step_logits = run.hf_batch_rows * shape.vocab * 4 * DECODE_STEP_LOGIT_COPIES
    generation = [Term("generation", kv + step_logits, run.heaviest(_call_rows_key(run), *TOKEN_KEYS))]
    if run.merged_lora and run.lora:
        merged = shape.lora_target_parameters * weight_bytes
        generation.append(Term("merged LoRA weights", merged, "perf.generate.merge_lora"))
    return generation


def _with_gpu_engine(result: MemoryEstimate, run: RunShape, state: list[Term], training: list[Term]) -> list[Term]:
    """The trainer GPU's terms with a vLLM engine's share of the GPU: on its own GPU (`result.engine_gpu`), woken
    beside the resident weights and optimizer state (sleep mode), or beside training."""
    if run.engine != "vllm":
        return training
    share = run.gpu_memory_utilization
    engine_bytes = int(share * run.engine_gpu_bytes) if run.engine_gpu_bytes else 0
    if not engine_bytes:
        result.engine_share = share
    engine = Term("vLLM engine", engine_bytes, "generator.gpu_memory_utilization")
    if run.engine_separate:
        result.engine_gpu = [engine]
        return training
    if run.sleep_mode:  # the engine wakes while the weights and optimizer state stay resident
        resident = [t for t in state if t.name != "gradients"]
        awake = sum(t.bytes for t in resident) + engine.bytes
        return [*resident, engine] if awake > sum(t.bytes for t in training) else training
    return [*training, engine]


TOKEN_KEYS = ("data.max_prompt_tokens", "generator.max_new_tokens")
"""The keys that set a sequence's length, beside whatever sets a term's rows."""


def _call_rows_key(run: RunShape) -> str:
    """The key that sets the rows of the widest HF generate call: the group (a call never splits a prompt's
    samples), `eval.batch_size` (the evaluator's greedy calls), or `generator.batch_size`."""
    if run.hf_batch_rows == run.samples_per_prefix:
        return run.group_key
    return "eval.batch_size" if run.hf_batch_rows == run.eval_rows > run.decode_rows else "generator.batch_size"


def fit_decode_rows(shape: ModelShape, run: RunShape, gpu_bytes: int | None) -> RunShape:
    """`run` with generator.batch_size=auto sized to the trainer's GPU (any other run comes back unchanged).

    The rank's whole round (`run.decode_rows` as `decode_rows` set it) when its estimate fits `GPU_FIT_SHARE` of
    the GPU, or when no GPU is visible to size it (a plan made on another machine); else the most whole groups
    (multiples of the variant's samples per prefix: a call never splits them) that fit, and one group when none does
    (the plan's check then refuses the run, naming the largest term's key).
    """
    if not (run.decode_rows_auto and run.trainer_on_gpu and run.engine == "hf") or gpu_bytes is None:
        return run
    group = max(1, run.samples_per_prefix)

    def with_rows(rows: int) -> RunShape:
        return dataclasses.replace(run, decode_rows=rows, hf_batch_rows=max(rows, group, run.eval_rows))

    def fits(rows: int) -> bool:
        return sum(t.bytes for t in estimate(shape, with_rows(rows)).trainer_gpu) <= GPU_FIT_SHARE * gpu_bytes

    if fits(run.decode_rows):
        return run
    low, high = 1, max(1, run.decode_rows // group)  # whole groups per call: `low` fits, `high` does not
    if not fits(low * group):
        return with_rows(group)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * group) else (low, middle)
    return with_rows(low * group)


def check_fits(result: MemoryEstimate, cpu_bytes: int, gpu_bytes: int | None = None) -> None:
    """Refuse a run whose estimate exceeds the machine: one line naming the key of the largest term that a
    setting can shrink. `gpu_bytes`: the total memory of one GPU when a GPU is visible (None: not checked)."""
    places = [("CPU RAM", result.cpu, cpu_bytes)]
    if gpu_bytes is not None:
        places += [("GPU memory", result.trainer_gpu, gpu_bytes), ("the engine GPU's memory", result.engine_gpu,
                                                                    gpu_bytes)]  # fmt: skip
    for place, terms, available in places:
        total = sum(t.bytes for t in terms)
        if not terms or total <= available:
            continue
        largest = max((t for t in terms if t.key and t.key != "model"), key=lambda t: t.bytes, default=None)
        advice = f"{largest.name} alone take ~{largest.bytes / GIB:.1f} GiB: lower {largest.key}" if largest else ""
        if largest is not None and largest.key in SWITCHES:
            advice = f"{largest.name} alone take ~{largest.bytes / GIB:.1f} GiB: set {_fix(largest.key)}"
        raise ValueError(
            f"this run needs about {total / GIB:.1f} GiB of {place} and the machine has {available / GIB:.1f} GiB; "
            f"{advice or 'choose a smaller model'} (estimate: {_render(terms)})"
        )


SWITCHES = {
    "model.lora.enabled": "model.lora.enabled=true (LoRA)",
    "loss.beta": "loss.beta=0 (no reference copy)",
    "perf.generate.merge_lora": "perf.generate.merge_lora=false (sample through the LoRA layers, no merged copy)",
}
"""Terms whose key is a switch: the refusal says how to set it, not to lower it."""


def _fix(key: str) -> str:
    return SWITCHES[key]
