"""The peak-memory estimate (grpo_lightning/app/memory.py) against independent counts, and the refusal it drives.

Truths: parameter counts of the model really built on the CPU and peft's own trainable-parameter count; every
term of a small run worked out by hand; the CLI's one-line refusal before anything loads.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_lightning.app.memory import (
    CUBLAS_WORKSPACE_BYTES,
    GIB,
    GPU_FIT_SHARE,
    PROCESS_BASELINE,
    ModelShape,
    check_fits,
    estimate,
    fit_decode_rows,
    model_shape,
)
from grpo_lightning.app.run_shape import RunShape
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from grpo_lightning.variants.baseline import BaselineGRPO

GRPO_8 = BaselineGRPO(num_generations=8).group()
"""The group of variant=grpo with G = 8."""


def _config(tie: bool = True):
    return AutoConfig.for_model(
        "llama", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tie,
    )  # fmt: skip


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("target", ["all-linear", ["q_proj", "v_proj"]])
def test_shape_counts_what_the_built_model_and_peft_count(tie, target):
    config = _config(tie)
    shape = model_shape(config, lora_r=8, target_modules=target)
    model = AutoModelForCausalLM.from_config(config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # a tied head counted once
    policy, _ = wrap_policy(model, LoraSettings(r=8, alpha=16, target_modules=target), needs_reference=False)
    assert shape.lora_parameters == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert (shape.hidden, shape.intermediate, shape.layers, shape.kv_width, shape.vocab) == (64, 96, 3, 32, 1000)
    targeted = [m.base_layer.weight for m in policy.modules() if hasattr(m, "base_layer")]  # what merging copies
    assert shape.lora_target_parameters == sum(w.numel() for w in targeted) > 0


SHAPE = ModelShape(parameters=10_000, lora_parameters=500, hidden=8, intermediate=16, layers=2, kv_width=4, vocab=50,
                   lora_target_parameters=6_000)  # fmt: skip


def _run(**changes) -> RunShape:
    base = dict(dtype="float32", lora=True, reference_copy=False, mixed_precision=False, prompt_tokens=10,
                new_tokens=5, group_size=4, groups_per_micro_batch=1, rollouts_per_round=8, share_prefix=False,
                logits_chunk_tokens=None, engine="hf", hf_batch_rows=2)  # fmt: skip
    return RunShape(**(base | changes))


def _terms(terms) -> dict[str, int]:
    return {t.name: t.bytes for t in terms}


def test_cpu_run_terms_by_hand():
    terms = _terms(estimate(SHAPE, _run()).cpu)
    tokens = 4 * (10 + 5)  # 4 rows of prompt + completion, no prefix sharing
    per_token = 2 * (10 * 8 + 5 * 16 + 2 * 4) * 4  # layers x (10h + 5i + 2kv) x float32
    assert terms == {
        "process": PROCESS_BASELINE,
        "weights": 10_000 * 4,
        "gradients": 500 * 4,
        "optimizer state": 2 * 500 * 4,
        "activations": tokens * per_token + tokens * 50 * 4 * 3,
        "rollouts": 8 * 15 * 48,
    }  # generation (2 rows x 15 x 2 x 2 layers x 4 x 4 B + logits) is smaller than the activations: not added


@pytest.mark.parametrize("lora", [True, False])
def test_overlap_holds_generation_beside_the_activations_and_a_copy_of_the_trainable_weights(lora):
    """rollout.max_staleness >= 1: the sampler's KV cache and logits exist while training's activations do, and
    the engine copy owns its trainable weights (a LoRA adapter in float32, or every weight)."""
    plain = _terms(estimate(SHAPE, _run(lora=lora)).cpu)
    overlapped = _terms(estimate(SHAPE, _run(lora=lora, overlap=True)).cpu)
    kv = 2 * 15 * 2 * 2 * 4 * 4  # 2 rows x 15 positions x (k, v) x 2 layers x kv width 4 x float32
    step_logits = 2 * 50 * 4 * 7  # 2 rows x vocab 50 x float32 x the 7 arrays a decode step holds (measured)
    assert overlapped == plain | {"generation": kv + step_logits, "sampler copy": (500 if lora else 10_000) * 4}


def test_prefix_sharing_chunked_logits_full_finetuning_and_reference():
    run = _run(share_prefix=True, logits_chunk_tokens=7, lora=False, reference_copy=True, dtype="bfloat16")
    terms = _terms(estimate(SHAPE, run).cpu)
    tokens = 10 + 4 * 5  # the prompt once, four completions
    per_token = 2 * (10 * 8 + 5 * 16 + 2 * 4) * 2  # bfloat16 weights: half-precision activations
    assert terms["activations"] == tokens * per_token + 7 * 50 * 4 * 3
    assert terms["weights"] == terms["reference copy"] == 10_000 * 2
    assert terms["gradients"] == 10_000 * 2 and terms["optimizer state"] == 2 * 10_000 * 2


def test_colocated_engine_wakes_beside_the_resident_training_state():
    gpu = 80 * GIB
    run = _run(engine="vllm", trainer_on_gpu=True, sleep_mode=True, gpu_memory_utilization=0.5, engine_gpu_bytes=gpu)
    result = estimate(SHAPE, run)
    trainer = _terms(result.trainer_gpu)
    assert trainer == {"weights": 40_000, "optimizer state": 4_000, "vLLM engine": 40 * GIB,  # no gradients then
                       "cuBLAS workspaces": 32 * 2**20}  # fmt: skip
    assert _terms(result.cpu)["sleeping engine's weights"] == 40_000
    separate = estimate(SHAPE, _run(engine="vllm", trainer_on_gpu=True, engine_separate=True, engine_gpu_bytes=gpu))
    assert _terms(separate.engine_gpu) == {"vLLM engine": int(0.3 * gpu)}
    assert "vLLM engine" not in _terms(separate.trainer_gpu)


def test_the_trainer_gpu_counts_a_cublas_workspace_per_stream():
    """By hand: 32 MiB (PyTorch's cuBLAS workspace on Hopper, measured on an H200) for each stream; on a CPU run no
    such term."""
    assert CUBLAS_WORKSPACE_BYTES == 32 * 2**20
    for streams in (1, 3, 4):
        trainer = _terms(estimate(SHAPE, _run(trainer_on_gpu=True, cuda_streams=streams)).trainer_gpu)
        assert trainer["cuBLAS workspaces"] == streams * 32 * 2**20
    assert "cuBLAS workspaces" not in _terms(estimate(SHAPE, _run()).cpu)


@pytest.mark.parametrize(
    ("overrides", "streams"),
    [
        ([], 3),  # the default stream, the CUDA-graph decode's warm-up and capture streams
        (["perf.generate.cuda_graphs=false"], 1),
        (["rollout.max_staleness=1"], 4),  # and the overlapped sampler's stream
        (["perf=plain"], 1),  # the plain preset decodes eagerly
        (["generator=vllm"], 1),  # the engine's streams are its own
    ],
)
def test_the_streams_counted_follow_the_config(tmp_path, overrides, streams):
    from grpo_lightning.app.run_shape import run_shape
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, ["trainer=gpu", *overrides])
    assert run_shape(cfg, GRPO_8, rollouts_per_round=16).cuda_streams == streams


def test_the_decode_rows_are_the_group_at_least():
    """A call never splits one prompt's G samples: G rows whatever generator.batch_size says, so a huge group is
    counted (and refused) by its decode step's [G, vocab] logits, naming variant.num_generations."""
    # overlap: both phases listed
    run = _run(group_size=1000, samples_per_prefix=1000, hf_batch_rows=1000, overlap=True)
    kv = 1000 * 15 * 2 * 2 * 4 * 4
    assert _terms(estimate(SHAPE, run).cpu)["generation"] == kv + 1000 * 50 * 4 * 7
    (term,) = [t for t in estimate(SHAPE, run).cpu if t.name == "generation"]
    assert term.key == "variant.num_generations"


def test_refusal_names_the_key_of_the_largest_term():
    result = estimate(SHAPE, _run(group_size=100_000))
    with pytest.raises(ValueError, match=r"of CPU RAM .* activations alone take .*: lower variant.num_generations"):
        check_fits(result, cpu_bytes=GIB)
    grouped = estimate(SHAPE, _run(groups_per_micro_batch=100_000))
    with pytest.raises(ValueError, match="lower data.groups_per_micro_batch"):
        check_fits(grouped, cpu_bytes=GIB)
    check_fits(estimate(SHAPE, _run()), cpu_bytes=GIB)  # fits: no error
    full = ModelShape(**(SHAPE.__dict__ | {"parameters": 2 * GIB // 4}))
    with pytest.raises(ValueError, match=r"optimizer state alone take .*set model.lora.enabled=true"):
        check_fits(estimate(full, _run(lora=False)), cpu_bytes=8 * GIB)


def test_gpu_refusal_only_when_a_gpu_size_is_given():
    result = estimate(SHAPE, _run(trainer_on_gpu=True, group_size=100_000))
    check_fits(result, cpu_bytes=64 * GIB)  # no GPU visible: the GPU estimate is printed, not checked
    with pytest.raises(ValueError, match=r"of GPU memory .*variant.num_generations"):
        check_fits(result, cpu_bytes=64 * GIB, gpu_bytes=GIB)


def test_a_group_that_cannot_fit_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """The mistake that used to end in the kernel's OOM kill (exit 137, no message) after a minute."""
    from grpo_lightning.models import sources as models
    from tests.test_bad_input import cli

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models.RandomSource, "load", never)
    result = cli("model=tiny", "variant.num_generations=100000", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "GiB of CPU RAM" in line and "lower variant.num_generations" in line


def test_the_plan_prints_the_estimate(tmp_path):
    from tests.test_bad_input import cli

    result = cli("model=tiny", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if "memory_cpu_ram" in x]
    assert "GiB (" in line and "weights" in line
    assert "activations" in line or "generation" in line  # the larger of the two phases, never both at once
    assert torch.cuda.is_available() or "memory_gpu" not in result.stdout  # trainer=cpu: no GPU estimate


def test_checkpointed_layers_keep_their_input_and_one_layer_by_hand():
    """perf.forward.activation_checkpointing: every layer's input in the weights' dtype (the residual stream, float32
    here though the activations are half precision under autocast), and one layer's 10h + 5i + 2kv values."""
    run = _run(activation_checkpointing=True, mixed_precision=True)
    terms = _terms(estimate(SHAPE, run).cpu)
    tokens = 4 * (10 + 5)
    per_token = 2 * 8 * 4 + (10 * 8 + 5 * 16 + 2 * 4) * 2  # layers x h x float32, one layer in bf16
    assert terms["activations"] == tokens * per_token + tokens * 50 * 4 * 3
    plain = _terms(estimate(SHAPE, _run(mixed_precision=True)).cpu)["activations"]
    assert plain - tokens * 50 * 4 * 3 == tokens * 2 * (10 * 8 + 5 * 16 + 2 * 4) * 2


@pytest.mark.parametrize("overlap", [False, True])
def test_sampling_with_lora_merged_counts_a_copy_of_the_targeted_weights(overlap):
    """perf.generate.merge_lora: a merged copy of every targeted linear weight lives while a call samples, beside
    its KV cache and logits; not with full fine-tuning (nothing to merge) nor with merge_lora off."""
    big_rows = dict(hf_batch_rows=64, overlap=overlap)  # generation larger than training: it is the peak
    terms = _terms(estimate(SHAPE, _run(merged_lora=True, **big_rows)).cpu)
    assert terms["merged LoRA weights"] == 6_000 * 4
    assert terms["generation"] == 64 * 15 * 2 * 2 * 4 * 4 + 64 * 50 * 4 * 7
    assert "merged LoRA weights" not in _terms(estimate(SHAPE, _run(**big_rows)).cpu)
    assert "merged LoRA weights" not in _terms(estimate(SHAPE, _run(merged_lora=True, lora=False, **big_rows)).cpu)


def test_the_phase_with_the_merged_copy_can_be_the_peak():
    """Training's activations exceed the decode's KV cache and logits alone, but not with the merged copy: the
    generation phase (both of its terms) is the peak, and training's activations are not listed."""
    run = _run(merged_lora=True)
    terms = _terms(estimate(ModelShape(**(SHAPE.__dict__ | {"lora_target_parameters": 10**6})), run).cpu)
    assert "activations" not in terms and terms["merged LoRA weights"] == 4 * 10**6 and "generation" in terms


def _gpu_run(**changes) -> RunShape:
    base = dict(trainer_on_gpu=True, decode_rows_auto=True, group_size=4, samples_per_prefix=4, decode_rows=64,
                hf_batch_rows=64)  # fmt: skip
    return _run(**(base | changes))


def test_auto_decode_rows_take_the_whole_round_when_it_fits():
    assert fit_decode_rows(SHAPE, _gpu_run(), 80 * GIB).decode_rows == 64
    assert fit_decode_rows(SHAPE, _gpu_run(), None).decode_rows == 64  # no GPU to size it: the round
    fixed = _gpu_run(decode_rows_auto=False)
    assert fit_decode_rows(SHAPE, fixed, 1) == fixed  # a number the user set is kept


def test_auto_decode_rows_shrink_to_the_most_whole_groups_that_fit():
    """Against brute force: the largest multiple of the group whose whole GPU estimate fits GPU_FIT_SHARE."""
    run = _gpu_run(overlap=True)  # the decode's terms add to training's: every row counts
    budget = sum(t.bytes for t in estimate(SHAPE, _gpu_run(overlap=True, decode_rows=24, hf_batch_rows=24))
                 .trainer_gpu) / GPU_FIT_SHARE + 1  # fmt: skip
    fitted = fit_decode_rows(SHAPE, run, int(budget))
    brute = max(
        rows for rows in range(4, 65, 4)
        if sum(t.bytes for t in estimate(SHAPE, _gpu_run(overlap=True, decode_rows=rows, hf_batch_rows=rows))
               .trainer_gpu) <= GPU_FIT_SHARE * int(budget)
    )  # fmt: skip
    assert fitted.decode_rows == brute == 24 and fitted.hf_batch_rows == 24
    assert fit_decode_rows(SHAPE, run, 1).decode_rows == 4  # nothing fits: one group (check_fits then refuses)


@pytest.mark.parametrize(
    ("overrides", "rows"),
    [
        ([], 16),  # the CPU default: 16 rows a call, as the CPU rounds are measured
        (["trainer=gpu"], 16),  # the default round: 2 prompts x 8
        (["trainer=gpu", "data.prompts_per_round=8"], 64),  # the whole round in one call
        (["trainer=gpu", "data.prompts_per_round=8", "generator.batch_size=24"], 24),  # a number is kept
        (["trainer=ddp", "trainer.devices=2", "trainer.accelerator=gpu", "data.prompts_per_round=8"], 32),  # a rank's
    ],
)
def test_auto_decode_rows_from_the_composed_config(tmp_path, overrides, rows):
    from grpo_lightning.app.run_shape import run_shape
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, overrides)
    run = run_shape(cfg, GRPO_8, rollouts_per_round=8 * cfg.data.prompts_per_round)
    assert run.decode_rows == rows


def test_the_7b_plan_with_long_completions_fits_a_gpu_with_trainer_gpu(tmp_path):
    """trainer=gpu's levers at Qwen2.5-7B's shape, LoRA, bf16, 8 prompts x 8 completions of 2,048 new tokens: the
    plan's trainer GPU estimate stays under 60 GiB (every activation kept, it was 130.9 GiB)."""
    from grpo_lightning.app.run_shape import run_shape
    from grpo_lightning.models.architectures import known_config
    from tests.conftest import make_cfg

    overrides = ["trainer=gpu", "model.dtype=bfloat16", "variant.num_generations=8", "data.prompts_per_round=8",
                 "generator.max_new_tokens=2048"]  # fmt: skip
    config = known_config("Qwen/Qwen2.5-7B-Instruct")
    shape = model_shape(config, lora_r=16, target_modules="all-linear")
    gpu = estimate(shape, run_shape(make_cfg(tmp_path, overrides), GRPO_8, 64)).trainer_gpu
    assert sum(t.bytes for t in gpu) <= 60 * GIB
    plain = run_shape(make_cfg(tmp_path, [*overrides, "perf=plain"]), GRPO_8, 64)
    assert sum(t.bytes for t in estimate(shape, plain).trainer_gpu) > 100 * GIB


def test_a_merged_copy_too_large_is_refused_with_the_switch_that_removes_it():
    """The refusal names how to set a switch (perf.generate.merge_lora=false), not "lower" it."""
    shape = ModelShape(**(SHAPE.__dict__ | {"lora_target_parameters": GIB}))  # 4 GiB merged in float32
    result = estimate(shape, _run(merged_lora=True))
    expected = r"merged LoRA weights alone take ~4.0 GiB: set perf.generate.merge_lora=false"
    with pytest.raises(ValueError, match=expected):
        check_fits(result, cpu_bytes=2 * GIB)


def _composed_run(tmp_path, overrides: list[str]):
    from grpo_lightning.app.run_shape import run_shape
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, overrides)
    return run_shape(cfg, GRPO_8, rollouts_per_round=8 * cfg.data.prompts_per_round)


def _keys(run) -> dict[str, str]:
    """Each CPU term's key, by the term's name (sampling and the training forward never peak together: one is
    kept)."""
    return {t.name: t.key for t in estimate(SHAPE, run).cpu}


def test_a_call_never_counts_more_rows_than_the_round_gives_it(tmp_path):
    """generator.batch_size above the rank's round (2 prompts x 8 = 16 rows) estimates what the round decodes: the
    same as a batch size of exactly 16."""
    huge = _composed_run(tmp_path, ["generator.batch_size=100000"])
    exact = _composed_run(tmp_path, ["generator.batch_size=16"])
    assert huge.decode_rows == 16 and estimate(SHAPE, huge).cpu == estimate(SHAPE, exact).cpu


def test_evaluation_rows_are_what_a_rank_evaluates_at_once_and_are_named_by_their_key(tmp_path):
    """eval.batch_size is capped at eval.num_problems (greedy: one row a problem), and when the evaluator's calls
    are the widest the generation term names eval.batch_size, not generator.batch_size."""
    assert _composed_run(tmp_path, ["eval.batch_size=100000"]).eval_rows == 32  # eval.num_problems' default
    run = _composed_run(tmp_path, ["eval.batch_size=100000", "eval.num_problems=5000", "generator.batch_size=8"])
    assert (run.eval_rows, run.hf_batch_rows) == (5000, 5000)
    assert _keys(run)["generation"] == "eval.batch_size"
    assert _composed_run(tmp_path, ["eval.enabled=false"]).eval_rows == 0


def test_a_prompt_limit_far_above_its_default_is_the_key_named(tmp_path):
    """data.max_prompt_tokens=10^8 makes every token term huge: each names data.max_prompt_tokens (the key that grew
    most over its declared default), where the group's size had been named."""
    run = _composed_run(tmp_path, ["data.max_prompt_tokens=100000000"])
    keys = _keys(run)
    assert keys["rollouts"] == keys.get("activations", keys.get("generation")) == "data.max_prompt_tokens"
    with pytest.raises(ValueError, match=r"lower data\.max_prompt_tokens"):
        check_fits(estimate(SHAPE, run), cpu_bytes=GIB)
    plain = _keys(_composed_run(tmp_path, []))  # at the defaults the group's key and the round's stay named
    assert (plain["activations"], plain["rollouts"]) == ("variant.num_generations", "data.prompts_per_round")
