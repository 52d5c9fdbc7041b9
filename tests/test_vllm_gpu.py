"""vLLM generator on a real CUDA engine (markers `vllm` and `gpu`: needs `make vllm` and a CUDA GPU).

Run with `pytest -m "vllm and gpu"`; tests/test_vllm.py runs the same truths on vLLM's CPU build in `make test-vllm`,
this file keeps what only a GPU has: sleep mode (colocated) and bfloat16 / CUDA kernels. The model is a random
2-layer Qwen2 with the SmolLM2 tokenizer, saved to a folder (vLLM loads from disk), in float32 so that trainer and
engine agree to ~1e-5 and greedy decoding is not at the mercy of bf16 near-ties. The end-to-end runs go through the
CLI in a subprocess each, so every engine owns its process (vLLM's in-process launcher initialises torch.distributed
once per process); the in-process tests share one engine (module fixture) and run in file order.

Truths: the trainer's own scoring, log_softmax(logits / T) of the HF model over prompt + completion, and greedy
decoding's determinism (a continuation of a greedy completion's prefix must reproduce its rest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import random_lm_config

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.7
LOGP_DIFF_BOUND = 1e-2  # the synced engine scores what the trainer scores


def _requirements():
    vllm = pytest.importorskip("vllm")
    if not torch.cuda.is_available() or vllm.platforms.current_platform.is_cpu():
        pytest.skip("needs a CUDA GPU and vLLM's CUDA build")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer) -> Path:
    """A random Qwen2 (hidden 256, 4 heads of 64, 2 KV heads, 2 layers) saved with the SmolLM2 tokenizer."""
    _requirements()
    from transformers import AutoModelForCausalLM

    config = random_lm_config("qwen2", tokenizer, hidden_size=256, heads=4, kv_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---- end to end through the CLI (each run owns its engine) ---------------------------------------------------
_BASE_ARGS = [
    "generator=vllm",
    "trainer=gpu",
    "trainer.precision=32-true",  # float32 both sides: the logp_diff bound is about the sync, not bf16
    "trainer.max_epochs=2",
    "trainer.enable_progress_bar=false",
    "model=qwen0.5b",
    "~model.source",
    "+model.source._target_=grpo_lightning.models.sources.LocalSource",
    "model.dtype=float32",
    "generator.max_new_tokens=16",
    "generator.max_model_len=1024",
    "+generator.engine_kwargs.enforce_eager=true",
    "generator.on_stale=abort",
    "~reward.terms.gsm8k",
    "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
    "eval.num_problems=4",
]


def _run_cli(tmp_path: Path, args: list[str]) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *args], capture_output=True, text=True, cwd=REPO, env=os.environ
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((tmp_path / "final_metrics.json").read_text())


def _cli_run(tmp_path: Path, qwen_dir: Path, *overrides: str) -> dict[str, float]:
    paths = [f"+model.source.path={qwen_dir}", f"paths.output_dir={tmp_path}"]
    return _run_cli(tmp_path, [*_BASE_ARGS, *paths, *overrides])


@pytest.mark.parametrize("variant", ["grpo", "storpo"])
def test_training_run_with_colocated_engine(tmp_path, qwen_dir, variant):
    """Two rounds, LoRA merged into the engine each round, sleep mode on; on_stale=abort fails a stale sync."""
    metrics = _cli_run(tmp_path, qwen_dir, f"variant={variant}")
    assert metrics["rollout/logp_diff_mean"] < LOGP_DIFF_BOUND
    assert metrics["rollout/completion_len_mean"] > 0
    assert "eval/gsm8k_accuracy" in metrics


def test_full_finetune_run(tmp_path, qwen_dir):
    metrics = _cli_run(tmp_path, qwen_dir, "model.lora.enabled=false", "loss.beta=0.0")
    assert metrics["rollout/logp_diff_mean"] < LOGP_DIFF_BOUND


# ---- one engine, in this process -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(qwen_dir, tokenizer):
    """(policy on cuda:0 with non-zero LoRA B, its colocated VLLMGenerator)."""
    from transformers import AutoModelForCausalLM

    from grpo_lightning.generation.vllm.generator import VLLMGenerator
    from grpo_lightning.models.lora import LoraSettings, wrap_policy

    base = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32)
    policy, _ = wrap_policy(base, LoraSettings(r=8, alpha=16), needs_reference=False)
    policy = policy.cuda().eval()
    gen = VLLMGenerator(
        policy,
        tokenizer,
        max_new_tokens=24,
        temperature=TEMPERATURE,
        dtype="float32",
        max_model_len=512,
        engine_kwargs={"enforce_eager": True},
    )
    return policy, gen


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in ("Natalia sold clips to 48 friends.", "What is 7 times 8?")]


@torch.no_grad()
def _trainer_logp_diff(policy, prefixes, groups) -> float:
    """Mean |engine log-prob - log_softmax(logits / T)[token]| over every sampled token (the trainer's scoring)."""
    total, count = 0.0, 0
    for prefix, group in zip(prefixes, groups, strict=True):
        for c in group:
            ids = torch.tensor([prefix + c.token_ids], device="cuda")
            logits = policy(input_ids=ids).logits[0, len(prefix) - 1 : -1].float() / TEMPERATURE  # [C, V]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prefix) :, None])[:, 0]  # [C]
            total += float((logp.cpu() - torch.tensor(c.logprobs)).abs().sum())
            count += len(c.token_ids)
    return total / count


def _randomize_lora_b(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen).to(param) * 0.2)


def test_generation_matches_the_trainer(setup, tokenizer):
    policy, gen = setup
    gen.sync_weights(policy)
    prefixes = _prompts(tokenizer)
    groups = gen.generate(prefixes, num_samples=4)
    assert [len(g) for g in groups] == [4, 4]
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.token_ids) <= 24 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.finished == (c.token_ids[-1] in gen.eos_token_ids)  # EOS is kept in token_ids
    assert _trainer_logp_diff(policy, prefixes, groups) < LOGP_DIFF_BOUND


def test_sync_after_a_change_moves_outputs_and_keeps_logprobs_right(setup, tokenizer):
    policy, gen = setup
    prefixes = _prompts(tokenizer)
    gen.sync_weights(policy)
    before = gen.generate(prefixes, num_samples=1, greedy=True)
    gen.sleep()  # as while a round trains
    _randomize_lora_b(policy, seed=1)  # "training" moved the adapters
    stale = gen.generate(prefixes, num_samples=4)  # woken without a sync: still the old weights
    stale_diff = _trainer_logp_diff(policy, prefixes, stale)
    gen.sync_weights(policy)
    after = gen.generate(prefixes, num_samples=1, greedy=True)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    fresh = gen.generate(prefixes, num_samples=4)
    fresh_diff = _trainer_logp_diff(policy, prefixes, fresh)
    assert fresh_diff < LOGP_DIFF_BOUND
    assert stale_diff > 10 * max(fresh_diff, 1e-4)  # the guard's metric separates stale from synced


def test_continuations_reproduce_their_prefixes(setup, tokenizer):
    """STORPO's branch requests: greedy from prompt + completion[:k] with budget N - k must give completion[k:]."""
    policy, gen = setup
    gen.sync_weights(policy)
    prompt = _prompts(tokenizer)[0]
    (initial,) = gen.generate([prompt], num_samples=1, max_new_tokens=24, greedy=True)[0]
    ks = [k for k in (1, 4, 9, 16) if k < len(initial.token_ids)]
    continuations = gen.generate(
        [prompt + initial.token_ids[:k] for k in ks], 1, max_new_tokens=[24 - k for k in ks], greedy=True
    )
    for k, (cont,) in zip(ks, continuations, strict=True):
        assert initial.token_ids[:k] + cont.token_ids == initial.token_ids, k
        assert cont.finished == initial.finished


def test_storpo_variant_on_the_engine(setup, tokenizer):
    from grpo_lightning.rewards.pipeline import pipeline_from_function
    from grpo_lightning.types import Prompt
    from grpo_lightning.variants.storpo import STORPO

    policy, gen = setup
    gen.sync_weights(policy)
    prompts = [Prompt(ids, answer="1", question="q", problem_index=i) for i, ids in enumerate(_prompts(tokenizer))]
    variant = STORPO(trees=1, completions_per_step=2, min_steps=1, max_steps=3, fallback_generations=4)
    reward = pipeline_from_function(lambda text, answer: float(len(text) % 2))
    rollouts = variant.generate_rollouts(gen, prompts, reward, tokenizer.decode)
    assert {r.group_id for r in rollouts} == {0, 1}
    for r in rollouts:
        assert len(r.completion_ids) <= gen.sampling.max_new_tokens
        first = next(x for x in rollouts if x.group_id == r.group_id and x.branch_point == 0)
        assert r.completion_ids[: r.branch_point] == first.completion_ids[: r.branch_point]


# ---- the GPU configuration users run: bf16, CUDA graphs, sleep levels, adapters, placement, recipes ----------------
BF16_LOGP_BOUND = 5e-2  # bf16 engine against the bf16 trainer: rounding, not staleness (stale pushes give ~0.2+)


def _bf16_run(tmp_path: Path, qwen_dir: Path, *overrides: str) -> dict[str, float]:
    """A two-round CLI run in bfloat16 with vLLM's defaults (CUDA graphs and torch.compile: no enforce_eager)."""
    args = [a for a in _BASE_ARGS if "enforce_eager" not in a and "precision" not in a and "dtype" not in a]
    args += ["trainer.precision=bf16-mixed", "model.dtype=bfloat16", f"generator.logp_diff_threshold={BF16_LOGP_BOUND}"]
    return _run_cli(tmp_path, [*args, f"+model.source.path={qwen_dir}", f"paths.output_dir={tmp_path}", *overrides])


def test_bf16_with_cuda_graphs_and_evaluation(tmp_path, qwen_dir):
    """The default GPU engine (compiled, CUDA graphs) in bf16, with evaluation on (NCCL default group)."""
    metrics = _bf16_run(tmp_path, qwen_dir)
    assert metrics["rollout/logp_diff_mean"] < BF16_LOGP_BOUND and "eval/gsm8k_accuracy" in metrics


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_levels(tmp_path, qwen_dir, level):
    """Level 1 offloads the weights to CPU memory, level 2 drops them: every round must push all of them."""
    metrics = _bf16_run(tmp_path, qwen_dir, f"generator.sleep_level={level}", "generator.enable_sleep_mode=true")
    assert metrics["rollout/logp_diff_mean"] < BF16_LOGP_BOUND


@pytest.mark.parametrize("rank", [4, 16])
def test_adapter_sync_in_bf16(tmp_path, qwen_dir, rank):
    """vLLM's Triton LoRA kernels; r=4 runs in vLLM's rank-8 slot (vLLM refuses max_lora_rank=4)."""
    metrics = _bf16_run(tmp_path, qwen_dir, "generator.lora_sync=adapter", f"model.lora.r={rank}")
    assert metrics["rollout/logp_diff_mean"] < BF16_LOGP_BOUND


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["generator.lora_sync=adapter", "model.lora.r=600"], "model.lora.r=600 is above vLLM's largest LoRA rank"),
        (["generator.lora_sync=adapter", "model.dtype=float32"], "generator.lora_sync=adapter needs model.dtype"),
        (["trainer.devices=[0]", "generator.device=cuda:0"], "generator.device=cuda:0 is one of the trainer's GPUs"),
    ],
)
def test_what_vllm_would_refuse_is_one_line_before_loading(tmp_path, qwen_dir, overrides, words):
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *_BASE_ARGS, f"+model.source.path={qwen_dir}",
         f"paths.output_dir={tmp_path}", *overrides],
        capture_output=True, text=True, cwd=REPO, env=os.environ,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert words in line and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the two-GPU layout needs two CUDA devices")
def test_engine_and_trainer_on_two_gpus(tmp_path, qwen_dir):
    """The separate layout: the engine on cuda:0 (no sleep mode), the trainer on cuda:1."""
    metrics = _bf16_run(tmp_path, qwen_dir, "generator.device=cuda:0", "trainer.devices=[1]",
                        "generator.gpu_memory_utilization=0.5")  # fmt: skip
    assert metrics["rollout/logp_diff_mean"] < BF16_LOGP_BOUND and "eval/gsm8k_accuracy" in metrics


@pytest.mark.parametrize("recipe", ["gsm8k_qwen0.5b", "gsm8k_qwen1.5b_2gpu"])
def test_recipe_two_rounds_on_the_embedded_model(tmp_path, recipe):
    """Each GPU recipe as published in conf/experiment/, on the embedded SmolLM2-135M for two rounds."""
    _requirements()
    if recipe.endswith("2gpu") and torch.cuda.device_count() < 2:
        pytest.skip("the two-GPU recipe needs two CUDA devices")
    overrides = [
        f"experiment={recipe}", "model=smollm2_135m", "model.dtype=bfloat16", "trainer.max_epochs=2",
        "eval.num_problems=16", "trainer.enable_progress_bar=false", f"paths.output_dir={tmp_path}",
    ]  # fmt: skip
    start = time.perf_counter()
    metrics = _run_cli(tmp_path, overrides)
    print(f"{recipe}, 2 rounds on the embedded model: {time.perf_counter() - start:.0f} s")
    assert metrics["rollout/logp_diff_mean"] < BF16_LOGP_BOUND and "eval/gsm8k_accuracy" in metrics
