"""Sampling with low-precision copies of the linear weights (`perf.generate.weights`, accel/low_precision.py).

Truths: brute-force quantization bounds and a float64 product of the dequantized weight; a second, plain
implementation of the bf16 model (a copy whose linear layers are cast to bf16 with hooks casting their inputs and
outputs); a teacher-forced forward of the sampled tokens through the same low-precision weights; the engine as it
samples without the lever; the policy's parameters before sampling; the composed config's rollout correction.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.low_precision import (
    check_device,
    dequantize_int8,
    int8_matmul,
    low_precision_linears,
    quantize_int8,
)
from grpo_lightning.generation import hf_engine as hf_module
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.hf_snapshot import SnapshotHFGenerator
from tests.conftest import make_cfg
from tests.helpers import lora_policy_with_random_adapters

TEMPERATURE = 0.8


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "A longer prompt with more words")]


def engine(model, tokenizer, seed_per_prefix: bool = False, **levers) -> HFGenerator:
    settings = GenerationSettings(**levers)
    return HFGenerator(
        model, tokenizer, max_new_tokens=12, temperature=TEMPERATURE, batch_size=6,
        seed_per_prefix=seed_per_prefix, generation_settings=settings,
    )  # fmt: skip


def flat(samples) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for group in samples for c in group]


def teacher_forced(model, prefix: list[int], completion: list[int]) -> torch.Tensor:  # [T] float32
    """log_softmax(logits / T) of each completion token, from one forward of prefix + completion."""
    ids = torch.tensor([prefix + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ---------------------------------------------------------------- int8 against brute force and float64


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_are_within_half_a_scale_of_the_originals(scale_dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 20, generator=gen) * torch.logspace(-3, 1, 12)[:, None]  # rows of every magnitude
    weight[3] = 0.0  # an all-zero row (a zero-initialised LoRA B)
    q, scale = quantize_int8(weight, scale_dtype)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.dtype == scale_dtype
    for o in range(weight.shape[0]):
        s = float(scale[o])
        largest = max(abs(float(w)) for w in weight[o])
        assert s * 127 >= largest * (1 - 2**-23)  # rounded up (to float32 rounding): nothing clipped
        for i in range(weight.shape[1]):
            assert -127 <= int(q[o, i]) <= 127
            assert abs(int(q[o, i]) * s - float(weight[o, i])) <= s / 2 * (1 + 2**-20)
    assert torch.equal(q[3], torch.zeros(20, dtype=torch.int8))
    torch.testing.assert_close(dequantize_int8(q, scale).double(), q.double() * scale.double()[:, None])


def test_int8_product_equals_a_float64_product_of_the_dequantized_weight():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(7, 96, generator=gen), torch.randn(160, 96, generator=gen)
    q, scale = quantize_int8(weight, torch.float32)
    expected = x.double() @ (q.double() * scale.double()[:, None]).T  # [7, 160]
    torch.testing.assert_close(int8_matmul(x, q, scale).double(), expected, rtol=1e-5, atol=1e-4)
    # the CPU path: bf16 activations and scales, the output rounded to bf16
    q, scale = quantize_int8(weight, torch.bfloat16)
    x16 = x.bfloat16()
    expected = x16.double() @ (q.double() * scale.double()[:, None]).T
    got = int8_matmul(x16, q, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_layers_compute_x_times_the_dequantized_weight(bias):
    """Each layer's output is the float64 product of its bf16-rounded input and its dequantized weight, rounded
    to bf16 (half a bf16 unit, 2^-9 relative; 2^-8 allowed for the float32 sum). 96 and 160 inputs go through
    torch's int8 kernel, 40 (not a multiple of 16) is dequantized on the fly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.Linear(160, 40, bias=bias), nn.Linear(40, 24, bias=bias))
    inputs = [torch.randn(2, 5, layer.in_features) for layer in model]
    with torch.inference_mode(), low_precision_linears(model, "int8") as count:
        outputs = [layer(x) for layer, x in zip(model, inputs, strict=True)]
        assert model(inputs[0]).shape == (2, 5, 24)
    assert count == 3
    for layer, x, got in zip(model, inputs, outputs, strict=True):
        q, scale = quantize_int8(layer.weight, torch.bfloat16)
        product = x.bfloat16().double() @ (q.double() * scale.double()[:, None]).T  # [2, 5, out]
        assert got.dtype == torch.float32
        bias_value = layer.bias.double() if bias else 0.0
        assert torch.all((got.double() - bias_value - product).abs() <= 2**-8 * product.abs() + 1e-6)
    assert all("forward" not in layer.__dict__ for layer in model)


# ---------------------------------------------------------------- bf16 against a plainly cast copy


def plainly_cast_copy(model: nn.Module) -> nn.Module:
    """A copy whose linear layers hold bf16 weights; hooks cast each one's input to bf16 and its output back. (Each
    layer gets a new bf16 parameter: a tied LM head's cast must leave the input embeddings float32.)"""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.detach().to(torch.bfloat16))
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(torch.bfloat16))
            module.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),))
            module.register_forward_hook(lambda m, args, out: out.float())
    return twin


def test_bf16_logits_equal_a_model_whose_linear_layers_are_cast_to_bf16(tiny_model, tokenizer):
    ids = torch.tensor([prompts(tokenizer)[1]])
    twin = plainly_cast_copy(tiny_model)
    with torch.inference_mode():
        expected = twin(input_ids=ids).logits
        plain = tiny_model(input_ids=ids).logits
        with low_precision_linears(tiny_model, "bfloat16") as count:
            got = tiny_model(input_ids=ids).logits
    assert count == sum(isinstance(m, nn.Linear) for m in tiny_model.modules())
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert not torch.equal(got, plain)  # it did compute in bf16


# ---------------------------------------------------------------- the engine


def test_float32_samples_exactly_what_the_engine_sampled_without_the_lever(tiny_model, tokenizer, monkeypatch):
    torch.manual_seed(5)
    got = flat(engine(tiny_model, tokenizer, weights="float32").generate(prompts(tokenizer), 3))
    monkeypatch.setattr(hf_module, "low_precision_linears", lambda model, weights: contextlib.nullcontext())
    torch.manual_seed(5)
    expected = flat(engine(tiny_model, tokenizer).generate(prompts(tokenizer), 3))
    assert got == expected  # tokens and log-probs, bit for bit


@pytest.mark.parametrize("custom_decode", [True, False])
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_logprobs_are_those_of_the_low_precision_forward_that_sampled(tiny_model, tokenizer, weights, custom_decode):
    gen = engine(tiny_model, tokenizer, weights=weights, custom_decode=custom_decode)
    torch.manual_seed(0)
    samples = gen.generate(prompts(tokenizer), 3)
    same_gaps, policy_gaps = [], []
    for prefix, group in zip(prompts(tokenizer), samples, strict=True):
        for c in group:
            got = torch.tensor(c.logprobs)
            with low_precision_linears(tiny_model, weights):
                same_gaps.append((got - teacher_forced(tiny_model, prefix, c.token_ids)).abs())
            policy_gaps.append((got - teacher_forced(tiny_model, prefix, c.token_ids)).abs())
    same, policy = torch.cat(same_gaps), torch.cat(policy_gaps)
    assert same.max() <= 1e-5  # the distribution that sampled (bit for bit on this CPU)
    # ... which is not the float32 policy's: on the tiny model the mean |gap| is ~7e-4 (bf16), ~1.5e-3 (int8)
    assert 1e-5 < policy.mean() < 0.05
    assert policy.mean() > 20 * same.mean()


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@pytest.mark.parametrize("merge_lora", [True, False])
def test_sampling_leaves_the_trained_parameters_untouched(tiny_model, tokenizer, weights, merge_lora):
    policy = lora_policy_with_random_adapters(tiny_model)
    before = {name: (p, p.detach().clone(), p.requires_grad, p.dtype) for name, p in policy.named_parameters()}
    samples = engine(policy, tokenizer, weights=weights, merge_lora=merge_lora).generate(prompts(tokenizer), 3)
    assert all(c.token_ids for group in samples for c in group)
    after = dict(policy.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, value, requires_grad, dtype) in before.items():
        assert after[name] is param and torch.equal(param, value)
        assert param.requires_grad == requires_grad and param.dtype == dtype
    assert not any("forward" in m.__dict__ for m in policy.modules())  # every layer's own forward again


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_merged_lora_is_cast_after_merging(tiny_model, tokenizer, weights):
    """merge_lora on and off sample from the same low-precision weights up to rounding: the merged weight is cast,
    not the base alone (the adapters would then be lost)."""
    policy = lora_policy_with_random_adapters(tiny_model, seed=3)
    ids = torch.tensor([prompts(tokenizer)[0]])
    logits = {}
    for merge in (True, False):
        gen = engine(policy, tokenizer, weights=weights, merge_lora=merge)
        with torch.inference_mode(), gen._decode_weights():
            logits[merge] = policy(input_ids=ids).logits
    with torch.inference_mode(), policy.disable_adapter():
        base = policy(input_ids=ids).logits
    gap = (logits[True] - logits[False]).abs().max()
    assert gap < 0.5 * (logits[True] - base).abs().max()  # the adapters' effect survives the cast


def test_packing_is_skipped_below_float32(tiny_model, tokenizer, monkeypatch):
    modes = []
    real = hf_module.packed_linears

    def recording(model, rows, mode):
        modes.append(mode)
        return real(model, rows, mode)

    monkeypatch.setattr(hf_module, "packed_linears", recording)
    engine(tiny_model, tokenizer, weights="bfloat16", packed_weights="auto").generate(prompts(tokenizer)[:1], 2)
    engine(tiny_model, tokenizer, weights="float32", packed_weights="auto").generate(prompts(tokenizer)[:1], 2)
    assert modes == [False, "auto"]


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_the_background_copy_samples_what_the_plain_engine_samples(tiny_model, tokenizer, weights):
    policy = lora_policy_with_random_adapters(tiny_model)
    plain = engine(policy, tokenizer, weights=weights, seed_per_prefix=True)
    plain.reseed(7)
    expected = flat(plain.generate(prompts(tokenizer), 3))
    background = SnapshotHFGenerator(engine(policy, tokenizer, weights=weights, seed_per_prefix=True))
    background.sync_weights(policy)
    background.reseed(7)
    assert flat(background.generate(prompts(tokenizer), 3)) == expected
    assert not any("forward" in m.__dict__ for m in background.model.modules())


# ---------------------------------------------------------------- the rollout correction and the one-line errors


@pytest.mark.parametrize(
    ("overrides", "engine_dtype", "active"),
    [
        ([], "auto", False),
        (["perf.generate.weights=float32"], "auto", False),
        (["perf.generate.weights=bfloat16"], "bfloat16", True),
        (["perf.generate.weights=int8"], "int8", True),
        (["perf=plain", "perf.generate.weights=int8"], "int8", True),
        (["perf.generate.weights=bfloat16", "loss.rollout_correction.enabled=false"], "bfloat16", False),
        (["model.dtype=bfloat16", "trainer.precision=bf16-mixed"], "auto", False),  # a bf16 policy samples itself
        (["generator=vllm", "perf.generate.weights=int8"], "float32", False),  # vLLM ignores perf.generate
    ],
)
def test_auto_correction_turns_on_with_the_lever(tmp_path, overrides, engine_dtype, active):
    from hydra.utils import instantiate

    correction = instantiate(make_cfg(tmp_path, overrides).loss).rollout_correction
    assert correction.engine_dtype == engine_dtype
    assert correction.active is active


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": "fp8"}, "perf.generate.weights must be one of float32, bfloat16, int8 (got 'fp8')"),
        (
            {"weights": "int8", "packed_weights": True},
            "perf.generate.packed_weights=true packs float32 weights only and perf.generate.weights=int8 samples "
            "with int8 copies: set perf.generate.packed_weights=auto or false",
        ),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        GenerationSettings(**kwargs)
    assert str(excinfo.value) == message


def test_the_config_check_names_the_key(tmp_path):
    from grpo_lightning.app.validation import validate

    with pytest.raises(ValueError) as excinfo:
        validate(make_cfg(tmp_path, ["perf.generate.weights=fp16"]))
    assert str(excinfo.value) == "perf.generate.weights must be one of float32, bfloat16, int8 (got 'fp16')"


def test_the_config_check_refuses_int8_on_a_gpu_trainer(tmp_path):
    from grpo_lightning.app.validation import validate

    with pytest.raises(ValueError) as excinfo:
        validate(make_cfg(tmp_path, ["trainer=gpu", "perf.generate.weights=int8"]))
    assert str(excinfo.value) == (
        "perf.generate.weights=int8 runs on the CPU only (torch's _weight_int8pack_mm CPU kernel) and "
        "trainer.accelerator=gpu puts the policy the HF engine samples from there: use perf.generate.weights=bfloat16 "
        "or float32"
    )


def test_int8_off_the_cpu_is_a_one_line_refusal():
    message = (
        "perf.generate.weights=int8 runs on the CPU only (torch's _weight_int8pack_mm CPU kernel); the policy is on "
        "cuda: use perf.generate.weights=bfloat16 or float32 there"
    )
    with pytest.raises(ValueError) as excinfo:
        check_device("int8", torch.device("cuda"))
    assert str(excinfo.value) == message
    check_device("bfloat16", torch.device("cuda"))  # bf16 runs anywhere
    layer = nn.Linear(4, 3, device="meta")
    with (
        pytest.raises(ValueError, match=r"^perf\.generate\.weights=int8 runs on the CPU only"),
        low_precision_linears(layer, "int8"),
    ):
        pass
    assert "forward" not in layer.__dict__
