"""TRL's GRPOTrainer vs grpo_lightning on identical work, one invocation, one subprocess per system.

    pip install -e '.[bench]'                      # TRL: a benchmark-only extra, never a runtime dependency
    GRPO_LIGHTNING_CACHE=/tmp/glcache python benchmarks/vs_trl.py --steps 4
    python benchmarks/vs_trl.py --check            # each loss, one shared batch: loss, KL and LoRA gradients agree

Identical work: the embedded SmolLM2-135M-Instruct (the converted safetensors folder, loaded with transformers
for TRL), fp32 (or `--bf16` for both), the same GSM8K prompts per step (our data module's seeded order, fed to
TRL unshuffled) with the same chat template, and the same reward (`GSM8KReward`, wrapped for TRL's
`reward_funcs`). Every other setting the two systems share is pinned on BOTH sides by `pins()`, which the run
prints and tests/unit/test_vs_trl_pins.py checks against both configs: sampling (G = 4 completions per prompt,
4 prompts per step, 128 new tokens, temperature 1, top-p 1, top-k 0), one sampling pass per step (our dynamic
sampling off), the loss (`--loss`, default `grpo`: type, ratio level, clip range, beta 0.04, no rollout
correction), group-scaled advantages, micro-batches of 4 completions, one optimizer step of 16, AdamW lr 5e-5
with betas (0.9, 0.99), no weight decay, a constant schedule without warmup, clip norm 1, LoRA r16 alpha 32
all-linear. TRL keeps its own defaults otherwise (gradient checkpointing on: `--trl-no-gc` turns it off), except
`use_bias_correction_kl=False`, which makes its KL gradient the plain k3 one we use (the values are the same
either way on-policy, the gradients are not).

On a GPU (`--gpu`), at the sizes users train, with random weights of a published architecture (no download):

    python benchmarks/vs_trl.py --gpu --model random_qwen0.5b --fixed-length --group 8 --prompts 8 \
        --micro 16 --systems trl ours_eager ours          # LoRA; --full: full fine-tuning
    benchmarks/gpu_step.sh .tok                           # the prepared GPU comparison, one JSON per run

`--model` is one of our `model=` presets; TRL gets the same model object (same architecture, same seed, same
weights, the embedded tokenizer). `--fixed-length` makes every completion `--max-new` tokens long on both sides
(TRL: `min_new_tokens`; ours: no token ends a row), so both do identical work whatever a random model samples.
`ours_eager` is this project with `perf.generate.cuda_graphs=false`; `ours` is the default (decode steps replayed
from CUDA graphs). Both sides sample in bf16 (`model.dtype=bfloat16`, TRL `bf16=True` on a bf16 model). The table
adds rollout tokens/s (generated tokens over generation time: TRL's `_generate`, our generate calls), peak GPU
memory (`torch.cuda.max_memory_allocated`) and, for ours, the plan's estimate of the trainer's GPU memory.

`trl_liger` (GPU only) is TRL's GRPOTrainer with `use_liger_kernel=True`, every other field as `trl`'s
(`TRL_SYSTEMS`): transformers patches Liger's Triton kernels into the model (RMSNorm, RoPE, SwiGLU, ...) and TRL
computes its loss with Liger's fused linear GRPO loss (the LM head and the loss together, a chunk of rows at a
time). Its subprocess needs the `liger_kernel` package and stops with one line when it is missing. The table's ratio
rows divide by the plain `trl` row; when a `trl_liger` row is present, our rows are also divided by it ("ratio ... /
TRL, Liger kernel").

Per step: wall time of a whole cycle (rollout + train + bookkeeping), median over the steps after the first.
Neither side writes a checkpoint during the run (ours: `checkpoint.last_every_n_rounds` = the step count, TRL:
`save_strategy='no'`), and our run's end (the last last.ckpt, the exported policy) is left out of the last step.
"rollout" is TRL's `_generate_and_score_completions` (generation, rewards AND its reference forward) and our
rollout callback's generation (the reference forward is in our train step). Peak RSS is the child's VmHWM.
Timings on a shared machine are noisy: compare the two systems within one invocation, by their ratio.

`--json PATH` writes one entry per system, keyed by its name (`trl`, `trl_liger`, `ours`, `ours_plain`,
`ours_eager`): the raw timings (`step_s`, `rollout_s`, `train_s`, `generate_s`: seconds per step; `completion_len`:
mean tokens per completion per step; `peak_rss_gb`, `peak_gpu_gb`, ours: `gpu_estimate_gb`, `round_end_s`,
`run_end_s`; `wall_s`: the whole subprocess) and, beside them, the facts of the run that produced them (`run_facts`,
taken in that system's subprocess): `device` (the GPU's name with `--gpu`, else the CPU's model name), `cpu_flags`
(on the CPU: which of avx2 / avx512f / avx512_bf16 / amx_tile it has, the kernels torch picks depend on them; null
on a GPU), `gpu`, `model` (the `model=` preset, `smollm2_135m` without `--model`), `tuning` (`lora` or `full`),
`loss`, `steps`, `group`, `prompts`, `max_new`, `micro`, `fixed_length`, `dtype` (`bf16` or `fp32`), `ours_override`
and `versions` (torch, transformers, peft, lightning, trl in TRL's subprocess, liger-kernel in `trl_liger`'s, and
CUDA with `--gpu`). `--check`'s entry is its per-loss comparison, without facts.

`--merge A.json B.json ...` prints the table of entries saved with `--json` (one system per invocation, say):
its caption and its rollout tokens/s come from the facts each entry recorded; the merging command's other flags
are ignored (rollout tokens/s: prompts x group x tokens per completion, `max_new` for a fixed-length run and the
recorded mean length otherwise, over the median generation seconds, `generate_s`). Entries must agree on the
device and on the work (`MERGE_KEYS`: model, tuning, loss, group, prompts, max-new, micro, fixed length, dtype);
otherwise the merge is refused with one line naming each fact that differs and its value in each file: a ratio
between systems means something only on the same work and the same machine, and one caption says so. An entry
without facts (written before they were recorded) is refused by name: rerun it, or add the fields to the JSON by
hand. A system in two files: the later file's entry.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "grpo_lightning" / "conf")
PROMPTS_PER_STEP, GROUP, MAX_NEW, MICRO, MAX_PROMPT = 4, 4, 128, 4, 512
BETA, LR, FORMAT_BONUS = 0.04, 5e-5, 0.1
# grpo_lightning with every speed lever off: plain `generate` (output_logits), full forward, full logits.
PLAIN = ["perf=plain"]
# Each compared loss: our `loss=<name>` preset, and the GRPOConfig fields that select the same loss in TRL 1.16
# (GSPO is TRL's `importance_sampling_level="sequence"` on its `grpo` aggregation; CISPO's cap is `epsilon_high`).
LOSSES = {
    "grpo": {"loss_type": "grpo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2},
    "bnpo": {"loss_type": "bnpo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2},
    "dr_grpo": {"loss_type": "dr_grpo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2},
    "dapo": {"loss_type": "dapo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.28},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "cispo": {"loss_type": "cispo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "vespo": {"loss_type": "vespo", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2},
    # grpo with TRL's entropy bonus (loss.entropy_coef), on the grpo preset
    "grpo_entropy": {
        "preset": "grpo",
        "loss_type": "grpo",
        "importance_sampling_level": "token",
        "epsilon_low": 0.2,
        "epsilon_high": 0.2,
        "entropy_coef": 0.05,
    },
}


@dataclass(frozen=True)
class Pin:
    """One setting both systems are given: our config key and value, TRL's field and value (None: that side has
    no such setting, and `what` says why that is the same work). `lora.<field>` is a field of TRL's LoraConfig."""

    what: str
    ours: str | None
    our_value: Any
    trl: str | None
    trl_value: Any


LOSS_TYPE_SETTINGS = {  # the loss types' own settings: (our key, TRL's field, the value both are given)
    "sapo": [("loss.sapo.temperature_pos", "sapo_temperature_pos", 1.0),
             ("loss.sapo.temperature_neg", "sapo_temperature_neg", 1.05)],
    "vespo": [("loss.vespo.k_pos", "vespo_k_pos", 2.0), ("loss.vespo.lambda_pos", "vespo_lambda_pos", 3.0),
              ("loss.vespo.k_neg", "vespo_k_neg", 3.0), ("loss.vespo.lambda_neg", "vespo_lambda_neg", 2.0)],
}  # fmt: skip


def loss_type_pins(loss: str) -> list[Pin]:
    return [Pin(f"{loss}: {trl}", ours, value, trl, value) for ours, trl, value in LOSS_TYPE_SETTINGS.get(loss, [])]


def pins(
    loss: str = "grpo",
    steps: int = 4,
    micro: int = MICRO,
    bf16: bool = False,
    prompts: int = PROMPTS_PER_STEP,
    max_new: int = MAX_NEW,
    group: int = GROUP,
) -> list[Pin]:
    """Every setting the comparison depends on, for both systems (`micro`: completions per forward/backward)."""
    spec = LOSSES[loss]
    dtype = "bfloat16" if bf16 else "float32"
    return [
        Pin("optimizer steps", "trainer.max_epochs", steps, "max_steps", steps),
        Pin("prompts per optimizer step (TRL: batch x accumulation / G)", "data.prompts_per_round",
            prompts, None, None),
        Pin("completions per prompt (G)", "variant.num_generations", group, "num_generations", group),
        Pin("completions per micro-batch (ours: whole groups)", "data.groups_per_micro_batch", micro // group,
            "per_device_train_batch_size", micro),
        Pin("micro-batches per optimizer step (ours: the whole round)", "trainer.accumulate_grad_batches", None,
            "gradient_accumulation_steps", prompts * group // micro),
        Pin("passes over a round (mu)", "data.num_iterations", 1, "num_iterations", 1),
        Pin("dynamic sampling (TRL samples once)", "data.dynamic_sampling.enabled", False, None, None),
        Pin("max new tokens", "generator.max_new_tokens", max_new, "max_completion_length", max_new),
        Pin("prompt tokens kept (TRL 1.16 keeps all; no prompt here is longer)", "data.max_prompt_tokens",
            MAX_PROMPT, None, None),
        Pin("temperature", "generator.temperature", 1.0, "temperature", 1.0),
        Pin("top-p", "generator.top_p", 1.0, "top_p", 1.0),
        Pin("top-k (0: off)", "generator.top_k", 0, "top_k", 0),
        Pin("min-p (ours: none)", None, None, "min_p", None),
        Pin("repetition penalty (ours: none)", None, None, "repetition_penalty", 1.0),
        Pin("loss preset", "loss", spec.get("preset", loss), None, None),
        Pin("loss type", "loss.loss_type", spec["loss_type"], "loss_type", spec["loss_type"]),
        Pin("ratio level (GSPO: sequence)", "loss.importance_sampling_level", spec["importance_sampling_level"],
            "importance_sampling_level", spec["importance_sampling_level"]),
        Pin("clip epsilon low", "loss.epsilon_low", spec["epsilon_low"], "epsilon", spec["epsilon_low"]),
        Pin("clip epsilon high (cispo: the weight's cap)", "loss.epsilon_high", spec["epsilon_high"],
            "epsilon_high", spec["epsilon_high"]),
        *loss_type_pins(loss),
        Pin("entropy bonus coefficient", "loss.entropy_coef", spec.get("entropy_coef", 0.0), "entropy_coef",
            spec.get("entropy_coef", 0.0)),
        Pin("dr_grpo's constant (TRL: max_completion_length)", "loss.max_completion_length", max_new, None, None),
        Pin("magnet weight (self-play over moves only; TRL has none)", "loss.magnet_coef", 0.0, None, None),
        Pin("KL weight beta", "loss.beta", BETA, "beta", BETA),
        Pin("KL times the ratio (ours: never)", None, None, "use_bias_correction_kl", False),
        Pin("rollout correction (TRL: vLLM only)", "loss.rollout_correction.enabled", False,
            "vllm_importance_sampling_correction", False),
        Pin("advantage scaling", "reward.group_transforms.normalize.scale", "group", "scale_rewards", "group"),
        Pin("reward's format bonus (TRL: the same GSM8KReward)", "reward.terms.gsm8k.format_bonus", FORMAT_BONUS,
            None, None),
        Pin("learning rate", "optim.optimizer.lr", LR, "learning_rate", LR),
        Pin("lr schedule", "optim.schedule.kind", "constant", "lr_scheduler_type", "constant"),
        Pin("warmup steps", "optim.schedule.warmup_steps", 0, "warmup_steps", 0),
        Pin("AdamW betas", "optim.optimizer.betas", [0.9, 0.99], "adam_beta1,adam_beta2", [0.9, 0.99]),
        Pin("weight decay", "optim.optimizer.weight_decay", 0.0, "weight_decay", 0.0),
        Pin("gradient clip norm", "trainer.gradient_clip_val", 1.0, "max_grad_norm", 1.0),
        Pin("seed", "seed", 0, "seed", 0),
        Pin("precision (ours: the weights' dtype, TRL: bf16 autocast)", "model.dtype", dtype, "bf16", bf16),
        Pin("LoRA rank", "model.lora.r", 16, "lora.r", 16),
        Pin("LoRA alpha", "model.lora.alpha", 32, "lora.lora_alpha", 32),
        Pin("LoRA dropout", "model.lora.dropout", 0.0, "lora.lora_dropout", 0.0),
        Pin("LoRA target modules", "model.lora.target_modules", "all-linear", "lora.target_modules", "all-linear"),
        Pin("evaluation during training (TRL: none)", "eval.enabled", False, None, None),
        Pin("last.ckpt only after the last round (TRL: save_strategy='no')", "checkpoint.last_every_n_rounds",
            steps, None, None),
    ]  # fmt: skip


def hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return str(value)


def our_overrides(pinned: list[Pin]) -> list[str]:
    """The Hydra overrides of our side: the loss preset first, then every pinned key."""
    by_key = {p.ours: p.our_value for p in pinned if p.ours is not None}
    first = [f"loss={by_key.pop('loss')}"]
    return first + [f"{key}={hydra_value(value)}" for key, value in by_key.items()]


def trl_fields(pinned: list[Pin]) -> dict[str, Any]:
    """The GRPOConfig fields of TRL's side (the LoRA rows go to `lora_config`)."""
    fields: dict[str, Any] = {}
    for p in pinned:
        if p.trl is None or p.trl.startswith("lora."):
            continue
        names = p.trl.split(",")
        values = p.trl_value if len(names) > 1 else [p.trl_value]
        fields.update(zip(names, values, strict=True))
    return fields


def print_pins(pinned: list[Pin], file=sys.stdout) -> None:
    print("| setting | grpo_lightning | TRL GRPOConfig |", file=file)
    print("|---|---|---|", file=file)
    for p in pinned:
        ours = "-" if p.ours is None else f"`{p.ours}={hydra_value(p.our_value)}`"
        trl = "-" if p.trl is None else f"`{p.trl}={p.trl_value!r}`"
        print(f"| {p.what} | {ours} | {trl} |", file=file)


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def compose(output_dir: str, pinned: list[Pin], extra: list[str] = ()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides = [*our_overrides(pinned), "trainer.enable_progress_bar=false", *extra]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = output_dir
    return cfg


def bench_prompts(cfg, steps: int):
    """(messages, answer) of every step's prompts, in our data module's order."""
    from hydra.utils import instantiate

    dm = instantiate(cfg.data)
    dm.setup("fit")
    rows = []
    for step in range(steps):
        for i in dm.problem_indices_for_round(step):
            problem = dm.problems[i]
            rows.append({"prompt": dm.dataset.messages(problem.question), "answer": problem.answer})
    return rows


def model_dir(cfg) -> str:
    from grpo_lightning.models.sources import PackagedGGUFSource

    return str(PackagedGGUFSource(cache_dir=os.path.expanduser(cfg.paths.cache_dir)).ensure_converted())


def never_ending(generator) -> None:
    """`--fixed-length`, our side: no token ends a row, so every completion is `generator.max_new_tokens` long (the
    engine stops a row at one of `eos_token_ids`; -1 is no token's id). TRL's side gets `min_new_tokens`."""
    generator.eos_token_ids = [-1]


def gpu_peak_gb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# ---- grpo_lightning ------------------------------------------------------------------------------------------
def run_ours(pinned: list[Pin], extra: list[str], fixed_length: bool = False) -> dict:
    import lightning as L

    from grpo_lightning.app.train import build_run
    from grpo_lightning.training.rollout_loop import RolloutLoop

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts, self.ends, self.rollout, self.lengths = [], [], [], []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            rc = next(c for c in trainer.callbacks if isinstance(c, RolloutLoop))
            self.rollout.append(rc.round_metrics["time/rollout_s"])
            self.lengths.append(rc.round_metrics["rollout/completion_len_mean"])
            self.starts.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, pl_module) -> None:  # runs first: before the next round's rollout
            self.ends.append(time.perf_counter())

    steps = next(p.our_value for p in pinned if p.ours == "trainer.max_epochs")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, pinned, extra)
        run = build_run(cfg)
        if fixed_length:
            never_ending(run.rollout_loop.generator)
        estimate = sum(t.bytes for t in run.plan.memory.trainer_gpu) / 2**30 if run.plan.memory.trainer_gpu else None
        timer = Timer()
        run.trainer.callbacks.insert(0, timer)
        run.fit()
        fit_end = time.perf_counter()
    out = {"system": "grpo_lightning", "step_s": [], "rollout_s": timer.rollout, "train_s": [], "round_end_s": []}
    for k in range(steps):
        # A round: its rollout (sampled at the previous round's end), its training, then its end (logging and
        # the next round's sampling, counted in that round). The last round's end is the run's: last.ckpt, the
        # exported policy and the closing summary, which TRL's side does not do (save_strategy='no'), so it is
        # kept out of that step (wall_s still holds it).
        train = timer.ends[k] - timer.starts[k]
        end = timer.starts[k + 1] - timer.ends[k] - timer.rollout[k + 1] if k + 1 < steps else 0.0
        out["train_s"].append(train)
        out["round_end_s"].append(end)
        out["step_s"].append(timer.rollout[k] + train + end)
    out["run_end_s"] = fit_end - timer.ends[-1]
    out["completion_len"] = timer.lengths
    out["generate_s"] = timer.rollout  # the rollout callback's generation (the reference forward is in training)
    out["gpu_estimate_gb"] = estimate
    return out


# ---- TRL -----------------------------------------------------------------------------------------------------
# TRL's systems: the GRPOConfig fields each sets beyond the shared ones (`trl_config`).
TRL_SYSTEMS: dict[str, dict[str, Any]] = {"trl": {}, "trl_liger": {"use_liger_kernel": True}}
LIGER_MISSING = "trl_liger needs liger-kernel: ../shared/tools/gpu-bundle liger-kernel==0.8.5 adds its wheel"


def trl_config(
    output_dir: str, pinned: list[Pin], gc: bool, gpu: bool = False, fixed_length: bool = False, system: str = "trl"
) -> dict[str, Any]:
    """The fields of TRL's GRPOConfig: every pinned one, what only says where and how often it writes, and the
    system's own (`TRL_SYSTEMS`; `use_liger_kernel` is set on every system, so theirs differ only in it)."""
    max_new = next(p.trl_value for p in pinned if p.trl == "max_completion_length")
    return {
        "output_dir": output_dir,
        "use_cpu": not gpu,
        "generation_kwargs": {"min_new_tokens": max_new} if fixed_length else None,
        **trl_fields(pinned),
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "shuffle_dataset": False,  # our data module's order, as bench_prompts lays it out
        "gradient_checkpointing": gc,
        "use_liger_kernel": False,
        **TRL_SYSTEMS[system],
    }


def trl_args(
    output_dir: str, pinned: list[Pin], gc: bool, gpu: bool = False, fixed_length: bool = False, system: str = "trl"
):
    """TRL's GRPOConfig (`trl_config`'s fields)."""
    from trl import GRPOConfig

    return GRPOConfig(**trl_config(output_dir, pinned, gc, gpu, fixed_length, system))


def require_liger() -> None:
    """`trl_liger`'s subprocess: stop with one line, not a traceback from inside TRL, when Liger is missing."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        sys.exit(LIGER_MISSING)


def gsm8k_reward_for_trl():
    from grpo_lightning.rewards.gsm8k import GSM8KReward

    reward = GSM8KReward(format_bonus=FORMAT_BONUS)

    def gsm8k(prompts, completions, answer, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(t, a) for t, a in zip(texts, answer, strict=True)]

    return gsm8k


def lora_config(pinned: list[Pin]):
    from peft import LoraConfig

    fields = {p.trl.removeprefix("lora."): p.trl_value for p in pinned if p.trl and p.trl.startswith("lora.")}
    return LoraConfig(**fields, task_type="CAUSAL_LM")


def check_prompt_lengths(rows, tokenizer) -> None:
    """TRL 1.16 never truncates a prompt; ours keeps the last `MAX_PROMPT` tokens: the same only when none is longer."""
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) > MAX_PROMPT:
            sys.exit(f"a benchmark prompt has {len(ids)} tokens > {MAX_PROMPT}: the two systems would differ")


def run_trl(
    pinned: list[Pin], gc: bool, model_choice: list[str] = (), gpu: bool = False, full: bool = False,
    fixed_length: bool = False, system: str = "trl",
) -> dict:  # fmt: skip
    """TRL's GRPOTrainer on the pinned work. `model_choice`: overrides naming one of our `model=` presets, loaded
    by its source (the random-weight architectures: the same weights as our side's, from the same seed); none: the
    embedded model's converted folder. Its dtype is the pinned precision's (bf16 with `--bf16`). `system`: one of
    `TRL_SYSTEMS`."""
    import torch
    from datasets import Dataset
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    steps = next(p.trl_value for p in pinned if p.trl == "max_steps")
    dtype = torch.bfloat16 if next(p.trl_value for p in pinned if p.trl == "bf16") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, pinned, list(model_choice))
        rows = bench_prompts(cfg, steps)
        if model_choice:
            model, tokenizer = instantiate(cfg.model.source).load(dtype)
            if full:  # TRL loads its reference model from the policy's `_name_or_path`: a folder, then
                folder = Path(tmp) / "model"
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                model.config._name_or_path = str(folder)
        else:
            folder = model_dir(cfg)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        check_prompt_lengths(rows, tokenizer)
        rollout: list[float] = []
        generate: list[float] = []

        class TimedGRPOTrainer(GRPOTrainer):
            def _generate_and_score_completions(self, inputs):
                start = time.perf_counter()
                result = super()._generate_and_score_completions(inputs)
                rollout.append(time.perf_counter() - start)
                return result

            def _generate(self, prompts):
                start = time.perf_counter()
                result = super()._generate(prompts)
                if gpu:
                    torch.cuda.synchronize()
                generate.append(time.perf_counter() - start)
                return result

        marks: list[float] = []

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                marks.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                marks.append(time.perf_counter())

        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward_for_trl(),
            args=trl_args(tmp, pinned, gc, gpu, fixed_length, system),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=None if full else lora_config(pinned),
            callbacks=[StepTimer()],
        )
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    step_s = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "system": system,
        "step_s": step_s,
        "rollout_s": rollout,
        "train_s": [s - r for s, r in zip(step_s, rollout, strict=False)],
        "completion_len": lengths,
        "generate_s": generate,
    }


# ---- same batch through both losses ----------------------------------------------------------------------------
# One batch of 2 prompts x G, 64 new tokens, in one forward/backward on both sides: TRL's loss keeps the full
# [B, T, vocab] logits and their entropy in its graph, so the timing benchmark's 16 x 128 would need ~15 GB.
CHECK_PROMPTS, CHECK_NEW = 2, 64
CHECK_MICRO = CHECK_PROMPTS * GROUP


def check_pins(loss: str) -> list[Pin]:
    return pins(loss, steps=1, micro=CHECK_MICRO, prompts=CHECK_PROMPTS, max_new=CHECK_NEW)


def off_policy(logp, mask):  # [B, C] -> [B, C]
    """Old log-probs that make the ratios move: every other completion on-policy (ratio 1), the others perturbed
    (seeded noise, and a few tokens far off: ratio e^2, above CISPO's cap of 5), so clipping, GSPO's sequence
    clip and CISPO's cap are all exercised."""
    import torch

    gen = torch.Generator().manual_seed(2)
    delta = torch.randn(logp.shape, generator=gen) * 0.3
    delta[:, ::7] = -2.0
    delta[::2] = 0.0
    return (logp.detach() + delta * mask).detach()


def check_one(name: str, rows, folder: str, tokenizer, batch_of) -> dict:
    """One loss type: TRL's `_compute_loss` and ours, from the same LoRA initialisation, on the same batch."""
    import torch
    from datasets import Dataset
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from grpo_lightning.algorithm.losses import aggregate
    from grpo_lightning.training.module import GRPOModule, LRSchedule

    pinned = check_pins(name)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, pinned)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward_for_trl(),
            args=trl_args(tmp, pinned, gc=False),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=lora_config(pinned),
        )
    policy = trainer.model  # the PeftModel TRL trains (with TRL's fused LM head patched in)
    with torch.no_grad():  # move the adapters off zero so the policy differs from the reference (KL > 0)
        gen = torch.Generator().manual_seed(1)
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 2e-3)
    batch = batch_of(policy, cfg)
    policy.train()

    # ours: the loss the config builds, the module's forward at the pinned temperature
    module = GRPOModule(
        policy, None, instantiate(cfg.loss), None, LRSchedule(), 1, temperature=cfg.generator.temperature
    )
    logp, terms = module.step_forward(batch)  # entropies too when the loss has an entropy bonus
    old = off_policy(logp, batch.completion_mask)
    mask = batch.completion_mask
    ref = module.reference_logprobs(batch)
    out = module.loss_fn(logp, old, ref, batch.advantages, mask, num_tokens_in_step=float(mask.sum()))
    loss = out.loss - module.entropy_bonus(batch, terms)[0] if module.loss_fn.entropy_coef else out.loss
    policy.zero_grad()
    loss.backward()
    ours_grad = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()

    # TRL, on the same tensors (its layout is ours: prompts left-padded, completions right-padded)
    p = batch.prompt_len
    inputs = {
        "prompt_ids": batch.input_ids[:, :p],
        "prompt_mask": batch.attention_mask[:, :p],
        "completion_ids": batch.input_ids[:, p:],
        "completion_mask": batch.attention_mask[:, p:],
        "advantages": batch.advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),  # dapo / cispo: the trained tokens of the step
    }
    with torch.no_grad(), policy.disable_adapter():
        input_ids = batch.input_ids
        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            policy, input_ids, batch.attention_mask, input_ids.shape[1] - p
        )[0]
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch here
    trl_loss = trainer._compute_loss(policy, inputs)
    trl_loss.backward()
    trl_grad = {n: q.grad.clone() for n, q in policy.named_parameters() if q.grad is not None}
    grad_diff = max(float((ours_grad[n] - trl_grad[n]).abs().max()) for n in ours_grad)
    grad_scale = max(float(g.abs().max()) for g in ours_grad.values())
    ref_diff = float(((inputs["ref_per_token_logps"] - ref).abs() * mask).max())
    result = {
        "loss_ours": float(loss.detach()),
        "loss_trl": float(trl_loss.detach()),
        "kl_ours": float(out.kl_mean),
        "kl_trl": trainer._metrics["train"]["kl"][-1],
        "clip_ratio_ours": float(out.clip_ratio),
        "ref_logp_max_abs_diff": ref_diff,
        "grad_max_abs_diff": grad_diff,
        "grad_max_abs": grad_scale,
        "num_tensors": len(ours_grad),
        "same_params": sorted(ours_grad) == sorted(trl_grad),
    }
    # A float32 difference of a token's term reaches the loss times that token's weight in the aggregation: the loss
    # of a per-token loss of 1 everywhere sums those weights (1 for the means; a sequence's length for luspo's sums).
    reach = float(aggregate(torch.ones_like(mask), mask, module.loss_fn.loss_type, module.loss_fn.max_completion_length,
                            float(mask.sum())))  # fmt: skip
    result["loss_tolerance"] = 1e-5 * max(1.0, abs(result["loss_trl"])) * max(1.0, reach)
    result["agree"] = (
        result["same_params"]
        and abs(result["loss_ours"] - result["loss_trl"]) <= result["loss_tolerance"]
        and grad_diff <= 1e-4 * grad_scale
    )
    return result


def vary_lengths(batch, pad_id: int):
    """Row i cut after at most C - 3 i tokens, so completion lengths differ and `grpo`, `bnpo` and `dr_grpo` give
    different losses (a random model never stops early, so all its completions run to the limit)."""
    import dataclasses

    import torch

    p, c = batch.prompt_len, batch.completion_mask.shape[1]
    keep = torch.arange(c)[None, :] < (c - 3 * torch.arange(len(batch)))[:, None]  # [B, C]
    input_ids, attention_mask = batch.input_ids.clone(), batch.attention_mask.clone()
    input_ids[:, p:] = torch.where(keep, input_ids[:, p:], pad_id)
    attention_mask[:, p:] *= keep
    return dataclasses.replace(
        batch,
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=batch.completion_mask * keep,
        gen_logprobs=batch.gen_logprobs * keep,
    )


def tiny_model_dir(cfg, folder: str) -> str:
    """`model=tiny` (the tests' random 2-layer Llama with the embedded tokenizer), saved where TRL can load it."""
    import torch
    from hydra.utils import instantiate

    model, tokenizer = instantiate(cfg.model.source).load(torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check(losses: list[str], tiny: bool = False) -> dict:
    """One batch of CHECK_PROMPTS x G completions (sampled once, at the pinned sampling), scored by our module and
    by TRL's `_compute_loss` for each loss type. Each starts from the same LoRA initialisation (same seed), with
    the adapters perturbed so the KL is non-zero, and old log-probs that move the ratios (`off_policy`). Compared:
    loss, mean KL (TRL's `kl` metric) and the gradient of every LoRA parameter. `tiny`: the random tiny model
    instead of the embedded SmolLM2 (seconds instead of minutes; the same code on both sides)."""
    import torch
    from transformers import AutoTokenizer

    from grpo_lightning.algorithm.rollouts import collate_rollouts
    from grpo_lightning.generation.hf import HFGenerator
    from grpo_lightning.rewards.pipeline import pipeline_from_function
    from grpo_lightning.types import Prompt
    from grpo_lightning.variants.baseline import BaselineGRPO

    keep = tempfile.TemporaryDirectory()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, check_pins(losses[0]), ["model=tiny"] if tiny else [])
        rows = bench_prompts(cfg, 1)
        folder = tiny_model_dir(cfg, keep.name) if tiny else model_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    check_prompt_lengths(rows, tokenizer)
    sampled = []

    def batch_of(policy, cfg):
        """The batch, sampled once with our generator from the first policy (all start the same)."""
        if sampled:
            return sampled[0]
        prompts = []
        for gid, row in enumerate(rows):
            text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append(Prompt(prompt_ids=ids, answer=row["answer"], question="", problem_index=gid))
        g = cfg.generator
        sampling = {key: g[key] for key in ("max_new_tokens", "temperature", "top_p", "top_k")}
        generator = HFGenerator(policy, tokenizer, **sampling)
        torch.manual_seed(0)
        rollouts = BaselineGRPO(num_generations=cfg.variant.num_generations).generate_rollouts(
            generator,
            prompts,
            pipeline_from_function(lambda t, a: 0.1 if "#" in t else len(t) % 7 / 7.0),  # dense: non-zero advantages
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        sampled.append(vary_lengths(collate_rollouts(rollouts, tokenizer.pad_token_id), tokenizer.pad_token_id))
        return sampled[0]

    from grpo_lightning.accel.heap_trim import release_freed_memory

    results = {}
    with keep:
        for name in losses:
            results[name] = check_one(name, rows, folder, tokenizer, batch_of)
            gc.collect()  # the loss's model, trainer and full logits: freed, and handed back before the next loss
            release_freed_memory()
    return results


# ---- driver ----------------------------------------------------------------------------------------------------
# Our side's variants: the overrides each adds to the pinned ones.
OUR_SYSTEMS = {"ours": [], "ours_plain": PLAIN, "ours_eager": ["perf.generate.cuda_graphs=false"]}
SYSTEM_NAMES = {
    "trl": "TRL GRPOTrainer",
    "trl_liger": "TRL GRPOTrainer, Liger kernel",
    "ours": "grpo_lightning",
    "ours_plain": "grpo_lightning, levers off",
    "ours_eager": "grpo_lightning, eager decode (no CUDA graphs)",
}


def pinned_for(args) -> list[Pin]:
    return pins(args.loss, args.steps, args.micro, args.bf16, args.prompts, args.max_new, args.group)


def model_overrides(args) -> list[str]:
    """Both sides' model: the preset, and with `--tokenizer-dir` its tokenizer from that folder (a machine without
    the packaged model, such as a GPU node: the random-weight presets need only the tokenizer)."""
    extra = [f"model={args.model}"] if args.model else []
    if args.tokenizer_dir:
        extra += [
            "~model.source.tokenizer_source",
            "+model.source.tokenizer_source._target_=grpo_lightning.models.sources.TokenizerFolder",
            f"+model.source.tokenizer_source.path={Path(args.tokenizer_dir).resolve()}",
        ]
    return extra


def ours_extra(args) -> list[str]:
    """Our side's overrides beyond the pins: the model, the GPU trainer, full fine-tuning."""
    extra = model_overrides(args)
    extra += ["trainer=gpu"] if args.gpu else []
    extra += ["model.lora.enabled=false"] if args.full else []
    return extra + list(args.ours_override)


# ---- run facts ---------------------------------------------------------------------------------------------------
DEFAULT_MODEL = "smollm2_135m"  # the config's default `model=` preset: the embedded SmolLM2-135M-Instruct
NOTABLE_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
# The facts two merged entries must share: the same work on the same machine (`--merge` refuses otherwise).
WORK_KEYS = ("model", "tuning", "loss", "group", "prompts", "max_new", "micro", "fixed_length", "dtype")
MERGE_KEYS = ("device", "gpu", *WORK_KEYS)
FACT_KEYS = (*MERGE_KEYS, "cpu_flags", "steps", "ours_override", "versions")


def cpu_facts(cpuinfo: str) -> tuple[str, list[str]]:
    """The CPU's model name and which of `NOTABLE_CPU_FLAGS` it has, from /proc/cpuinfo's text (its first
    processor: every core of a machine is the same model)."""
    import platform

    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    return name, [f for f in NOTABLE_CPU_FLAGS if f in flags]


def package_versions(gpu: bool) -> dict[str, str | None]:
    """The installed versions of the stack both sides run on; trl's and liger-kernel's only where they were
    imported (TRL's subprocesses: ours never imports them); CUDA's (the one torch was built with) on a GPU."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "peft", "lightning"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    if "trl" in sys.modules:
        versions["trl"] = getattr(sys.modules["trl"], "__version__", None)
    if "liger_kernel" in sys.modules:  # trl_liger's subprocess
        try:
            versions["liger-kernel"] = version("liger-kernel")
        except PackageNotFoundError:
            versions["liger-kernel"] = None
    if gpu:
        import torch

        versions["cuda"] = torch.version.cuda
    return versions


def run_facts(args, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """What a system's timings were measured on and for, written beside them by `--json` so that `--merge` reads
    the work from the file rather than from its own flags (whose defaults are the CPU run's)."""
    if args.gpu:
        import torch

        device, flags = torch.cuda.get_device_name(), None
    else:
        device, flags = cpu_facts(cpuinfo.read_text() if cpuinfo.exists() else "")
    return {
        "device": device,
        "cpu_flags": flags,
        "gpu": bool(args.gpu),
        "model": args.model or DEFAULT_MODEL,
        "tuning": "full" if args.full else "lora",
        "loss": args.loss,
        "steps": args.steps,
        "group": args.group,
        "prompts": args.prompts,
        "max_new": args.max_new,
        "micro": args.micro,
        "fixed_length": bool(args.fixed_length),
        "dtype": "bf16" if args.bf16 else "fp32",
        "ours_override": list(args.ours_override),
        "versions": package_versions(args.gpu),
    }


def load_results(paths: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Every system's entry of the `--json` files (a system in two files: the later one), and the file each came
    from. An entry without the run facts cannot be tabled: its work is unknown, and the flags' defaults (the CPU
    run's) would caption and rate it wrongly."""
    results, where = {}, {}
    for path in paths:
        for name, entry in json.loads(Path(path).read_text()).items():
            if name not in SYSTEM_NAMES:
                sys.exit(f"--merge: {path}: {name!r} is not a timed system (one of {', '.join(SYSTEM_NAMES)})")
            missing = [key for key in FACT_KEYS if key not in entry]
            if missing:
                what = "all of them" if len(missing) == len(FACT_KEYS) else ", ".join(missing)
                sys.exit(
                    f"--merge: {path}: entry {name!r} lacks the run facts (missing: {what}), written before --json "
                    "recorded them: rerun it with --json, or add the fields by hand (see the module docstring)"
                )
            results[name], where[name] = entry, path
    return results, where


def shared_facts(results: dict[str, dict], where: dict[str, str] | None = None) -> dict:
    """The facts every entry shares (`MERGE_KEYS`); exits with one line naming each that differs and its value in
    each entry (`where`: system -> the file it came from)."""
    differ = []
    for key in MERGE_KEYS:
        values = [(entry[key], f"{name} in {where[name]}" if where else name) for name, entry in results.items()]
        if len({json.dumps(v) for v, _ in values}) > 1:
            differ.append(f"{key} " + " vs ".join(f"{v!r} ({label})" for v, label in values))
    if differ:
        prefix = "--merge: " if where else ""
        sys.exit(f"{prefix}the entries are not the same work on the same device, refused: " + "; ".join(differ))
    return {key: next(iter(results.values()))[key] for key in MERGE_KEYS}


def child(args) -> None:
    from grpo_lightning.openmp import set_openmp_wait

    set_openmp_wait()  # before torch loads, as `python -m grpo_lightning` does: both systems wait alike
    pinned = pinned_for(args)
    if args.child in OUR_SYSTEMS:
        result = run_ours(pinned, ours_extra(args) + OUR_SYSTEMS[args.child], args.fixed_length)
        result["system"] = args.child
    elif args.child in TRL_SYSTEMS:
        if args.child == "trl_liger":
            require_liger()
        result = run_trl(
            pinned, not args.trl_no_gc, model_overrides(args), args.gpu, args.full, args.fixed_length, args.child
        )
    else:
        result = check(args.check_losses, tiny=args.tiny)
    if args.child != "check":  # --check's entry maps each loss to its comparison: no room for facts
        result |= run_facts(args)
    result["peak_rss_gb"] = peak_rss_gb()
    result["peak_gpu_gb"] = gpu_peak_gb()
    Path(args.out).write_text(json.dumps(result))


def median_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.median(rest) if rest else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per system (median over steps 2..N)")
    parser.add_argument("--only", choices=["ours", "trl"], help="run one system")
    parser.add_argument("--loss", choices=list(LOSSES), default="grpo", help="the loss both systems train with")
    parser.add_argument("--check", action="store_true", help="compare loss / KL / gradients on one batch, then exit")
    parser.add_argument(
        "--check-losses", nargs="+", choices=list(LOSSES), default=list(LOSSES), help="the losses --check compares"
    )
    parser.add_argument("--tiny", action="store_true", help="--check on the random tiny model (seconds)")
    parser.add_argument("--trl-no-gc", action="store_true", help="TRL without its default gradient checkpointing")
    parser.add_argument("--bf16", action="store_true", help="bf16 for both (TRL: bf16 autocast; ours: model.dtype)")
    parser.add_argument("--ours-override", action="append", default=[], help="extra Hydra override for our side")
    parser.add_argument("--json", help="write the raw per-step results here")
    parser.add_argument("--plain", action="store_true", help="also run grpo_lightning with every lever off")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEM_NAMES), help="the systems to run, in order")
    parser.add_argument("--model", help="one of our model= presets for both sides (default: the embedded model)")
    parser.add_argument("--gpu", action="store_true", help="both sides on the CUDA GPU, in bf16 (implies --bf16)")
    parser.add_argument("--full", action="store_true", help="full fine-tuning on both sides instead of LoRA")
    parser.add_argument("--tokenizer-dir", help="--model's tokenizer from this folder (no packaged model here)")
    parser.add_argument("--fixed-length", action="store_true", help="every completion --max-new tokens long")
    parser.add_argument("--group", type=int, default=GROUP, help="completions per prompt (G)")
    parser.add_argument("--prompts", type=int, default=PROMPTS_PER_STEP, help="prompts per optimizer step")
    parser.add_argument("--max-new", type=int, default=MAX_NEW, help="new tokens per completion (at most)")
    parser.add_argument("--micro", type=int, default=MICRO, help="completions per micro-batch (whole groups)")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="print the table of runs saved with --json (one system each, say)"
    )
    parser.add_argument("--child", choices=["check", *SYSTEM_NAMES], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:  # the files' recorded facts, not these flags, say what the runs were
        print_table(*load_results(args.merge))
        return
    args.bf16 = args.bf16 or args.gpu
    if args.micro % args.group or (args.prompts * args.group) % args.micro:
        parser.error("--micro must be a multiple of --group and divide --prompts x --group")
    if "trl_liger" in (args.systems or []) + [args.child] and not args.gpu:
        parser.error("trl_liger runs Liger's Triton kernels: only with --gpu")
    if args.child:
        child(args)
        return

    if args.check:
        print(f"Pinned on both sides (--check: one micro-batch of {CHECK_MICRO}, one step):\n")
        print_pins(check_pins(args.check_losses[0]))
        print_loss_pins(args.check_losses)
    else:
        print(f"Pinned on both sides (--loss {args.loss}):\n")
        print_pins(pinned_for(args))
    if ours_extra(args):
        print(f"\nour side also: {' '.join(ours_extra(args))}")
    if args.check:
        systems = ["check"]
    elif args.systems:
        systems = list(args.systems)
    else:
        systems = [s for s in ("trl", "ours") if args.only in (None, s)]
        if args.plain:
            systems.insert(-1 if "ours" in systems else len(systems), "ours_plain")
    results = {}
    for system in systems:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", system, "--out", out]  # the child reads the same
        print(f"running {system} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL if system != "check" else None)
        if proc.returncode:
            sys.exit(f"{system} failed with exit code {proc.returncode}")
        results[system] = json.loads(Path(out).read_text()) | {"wall_s": time.perf_counter() - start}
        os.unlink(out)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.check:
        print_check(results["check"])
        if not all(r["agree"] for r in results["check"].values() if isinstance(r, dict)):
            sys.exit("--check: the two losses disagree (see the table)")
        return
    print_table(results)


def print_loss_pins(losses: list[str]) -> None:
    print("\n| loss | loss_type | importance_sampling_level | epsilon low / high | beta |")
    print("|---|---|---|---|---|")
    for name in losses:
        spec = LOSSES[name]
        print(
            f"| {name} | {spec['loss_type']} | {spec['importance_sampling_level']} | "
            f"{spec['epsilon_low']:g} / {spec['epsilon_high']:g} | {BETA} |"
        )


def print_check(results: dict) -> None:
    print(json.dumps(results, indent=1))
    print("\n| loss | loss ours | loss TRL | KL ours | KL TRL | clip ratio | max grad diff / max grad | agree |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        print(
            f"| {name} | {r['loss_ours']:.6g} | {r['loss_trl']:.6g} | {r['kl_ours']:.6g} | {r['kl_trl']:.6g} | "
            f"{r['clip_ratio_ours']:.3g} | {r['grad_max_abs_diff']:.2g} / {r['grad_max_abs']:.2g} | {r['agree']} |"
        )


def completion_tokens(facts: dict, lengths: list[float]) -> float:
    """Tokens of one completion, on average: `max_new` for a fixed-length run (every completion is that long on
    both sides), else the recorded mean length."""
    if facts["fixed_length"]:
        return float(facts["max_new"])
    return statistics.mean(lengths) if lengths else float("nan")


def caption(facts: dict, results: dict[str, dict]) -> str:
    """The table's caption, from the recorded facts (`facts`: the shared ones; the steps and the versions from
    every entry, each value once)."""
    flags = next(iter(results.values()))["cpu_flags"]  # the same device: the same flags
    device = facts["device"] + (f" ({' '.join(flags)})" if flags else "")
    tuning = "full fine-tuning" if facts["tuning"] == "full" else "LoRA r16"
    steps = "/".join(str(n) for n in sorted({entry["steps"] for entry in results.values()}))
    versions = {}
    for entry in results.values():
        for package, version in entry["versions"].items():
            versions.setdefault(package, [])
            if version not in versions[package]:
                versions[package].append(version)
    stack = ", ".join(f"{package} {' / '.join(str(v) for v in vs)}" for package, vs in versions.items())
    overrides = sorted({" ".join(entry["ours_override"]) for entry in results.values()} - {""})
    return (
        f"{device}: {facts['model']}, {tuning}, {steps} steps, {facts['prompts']} prompts x {facts['group']} "
        f"completions, {facts['max_new']} new tokens{' (fixed)' if facts['fixed_length'] else ''}, micro-batches "
        f"of {facts['micro']}, loss {facts['loss']}, beta {BETA}, {facts['dtype']}; median over steps 2..N\n"
        f"versions: {stack}" + "".join(f"\nour side also: {o}" for o in overrides)
    )


def print_table(results: dict[str, dict], where: dict[str, str] | None = None) -> None:
    """The systems' table, its caption and rates from the facts the entries recorded (`where`: system -> the file
    it came from, for `--merge`'s refusal)."""
    facts = shared_facts(results, where)
    rows = []
    for name, r in results.items():
        length = statistics.mean(r["completion_len"]) if r["completion_len"] else float("nan")
        generate = median_after_first(r.get("generate_s") or [])
        tokens = facts["prompts"] * facts["group"] * completion_tokens(facts, r["completion_len"])  # per step
        rows.append(
            {
                "system": SYSTEM_NAMES[name],
                "name": name,
                "step": median_after_first(r["step_s"]),
                "rollout": median_after_first(r["rollout_s"]),
                "train": median_after_first(r["train_s"]),
                "tokens_s": tokens / generate if generate else float("nan"),
                "rss": r["peak_rss_gb"],
                "gpu": r.get("peak_gpu_gb"),
                "estimate": r.get("gpu_estimate_gb"),
                "len": length,
                "steps": " ".join(f"{s:.1f}" for s in r["step_s"]),
            }
        )
    print(f"\n{caption(facts, results)}\n")
    gpu = facts["gpu"]
    columns = ["system", "step s", "rollout s", "train s", "rollout tokens/s"]
    columns += ["peak GPU GiB", "GPU estimate GiB"] if gpu else ["peak RSS GB"]
    columns += ["mean completion len", "all steps s"]
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        memory = f" {r['gpu']:.2f} | {_gib(r['estimate'])} |" if gpu else f" {r['rss']:.2f} |"
        print(
            f"| {r['system']} | {r['step']:.2f} | {r['rollout']:.2f} | {r['train']:.2f} | {r['tokens_s']:.0f} |"
            f"{memory} {r['len']:.0f} | {r['steps']} |"
        )
    by_name = {r["name"]: r for r in rows}
    # Our rows over the plain TRL row, then (when present) over TRL with the Liger kernel.
    for base, label in (("trl", "TRL"), ("trl_liger", "TRL, Liger kernel")):
        trl = by_name.get(base)
        for name in ("ours_plain", "ours_eager", "ours"):
            if trl and name in by_name:
                r = by_name[name]
                memory = f" {r['gpu'] / trl['gpu']:.2f} | |" if gpu else f" {r['rss'] / trl['rss']:.2f} |"
                print(
                    f"| ratio {r['system']} / {label} | {r['step'] / trl['step']:.2f} | "
                    f"{r['rollout'] / trl['rollout']:.2f} | {r['train'] / trl['train']:.2f} | "
                    f"{r['tokens_s'] / trl['tokens_s']:.2f} |{memory} | |"
                )


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
