"""MKL-packed linear layers for generation (grpo_lightning/accel/packed_weights.py) against F.linear."""

import pytest
import torch
from torch import nn

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel import packed_weights as packed_module
from grpo_lightning.accel.packed_weights import PackingTrial, packed_linears, packing_available, packing_trial
from grpo_lightning.generation.hf import HFGenerator
from tests.helpers import lora_policy_with_random_adapters

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no MKL packed GEMM")


@pytest.mark.parametrize("bias", [False, True])
def test_forced_packing_equals_f_linear_for_any_rows(bias):
    """Within float rounding everywhere; bit for bit where this CPU's trial finds the packed product exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.Linear(160, 40, bias=bias))
    inputs = [torch.randn(16, 96), torch.randn(3, 96), torch.randn(16, 1, 96), torch.randn(2, 7, 96)]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
        with packed_linears(model, rows=16, mode=True) as packed:
            assert packed == 2
            got = [model(x) for x in inputs]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    if packing_trial(160, 96, 16).exact and packing_trial(40, 160, 16).exact:
        assert torch.equal(expected[0], got[0])  # the trial's verdict holds for other inputs of its shape
    assert all("forward" not in layer.__dict__ for layer in model)  # nn.Linear.forward again


def test_trial_reports_exactness_and_size_of_the_packed_product():
    trial = packing_trial(160, 96, 16)
    assert packing_trial(160, 96, 16) is trial  # measured once per process
    torch.manual_seed(1)
    weight, x = torch.randn(160, 96), torch.randn(16, 96)
    with torch.inference_mode():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 16)
        exact = torch.equal(nn.functional.linear(x, weight), torch.ops.mkl._mkl_linear(x, packed, weight, None, 16))
    assert trial.exact == exact
    assert trial.size_ratio == pytest.approx(packed.numel() * packed.element_size() / (160 * 96 * 4))
    assert trial.speedup > 0


@pytest.mark.parametrize(("shape", "calls"), [((1536, 576, 16), 22), ((1536, 576, 1), 22), ((1536, 576, 64), 5),
                                             ((8192, 64, 1024), 2), ((64, 64, 1024), 50)])  # fmt: skip
def test_a_trial_times_its_product_on_a_budget_of_multiply_adds(monkeypatch, shape, calls):
    """Each timing repeats the product `calls` times: TRIAL_MACS over one product's multiply-adds (its rows counted
    from 16 up), within 2..50: the row count of a large group makes each product longer and the timing shorter."""
    timed = []
    monkeypatch.setattr(packed_module, "_best_time", lambda fn, calls: timed.append(calls) or 1.0)
    packing_trial.__wrapped__(*shape)
    assert timed == [calls, calls]  # F.linear, then the packed product


@pytest.mark.parametrize(
    ("trial", "pays"),
    [
        (PackingTrial(exact=True, size_ratio=1.0, speedup=1.8), True),
        (PackingTrial(exact=False, size_ratio=1.0, speedup=1.8), False),  # would change sampled tokens
        (PackingTrial(exact=True, size_ratio=3.35, speedup=1.8), False),  # AMD EPYC's padded buffers
        (PackingTrial(exact=True, size_ratio=1.0, speedup=1.05), False),  # not worth a copy of the weights
    ],
)
def test_a_shape_is_packed_only_when_exact_small_and_faster(trial, pays):
    assert trial.pays(min_speedup=1.15, max_size_ratio=1.5) is pays


def test_auto_packs_only_the_layers_whose_trial_pays(monkeypatch):
    monkeypatch.setattr(packed_module, "_trial_pays", lambda layer, rows: layer.out_features == 40)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 40))
    with packed_linears(model, rows=16, mode="auto") as packed:
        assert packed == 1
        assert "forward" in model[1].__dict__ and "forward" not in model[0].__dict__
    with packed_linears(model, rows=16, mode=False) as packed:
        assert packed == 0


def test_grad_inputs_and_other_dtypes_are_left_to_f_linear():
    torch.manual_seed(0)
    layer, half = nn.Linear(32, 8), nn.Linear(32, 8).to(torch.bfloat16)
    x = torch.randn(4, 32, requires_grad=True)
    with packed_linears(nn.ModuleList([layer, half]), rows=4) as packed:
        assert packed == 1  # the bf16 layer is not packed
        layer(x).sum().backward()  # a gradient still flows: F.linear ran
    assert torch.allclose(x.grad, layer.weight.sum(0).expand(4, 32))


@pytest.mark.parametrize("custom_decode", [True, False])
def test_generation_with_auto_packed_weights_is_identical(tiny_model, tokenizer, custom_decode, monkeypatch):
    """`auto` packs exact shapes only, so sampled tokens and log-probs are those of the plain path bit for bit.

    The speed and size criteria are dropped here so that every exact shape is packed (4 prompts x G 4 = 16 rows).
    """

    def exact_only(layer, rows):
        return packing_trial(layer.out_features, layer.in_features, rows).exact

    monkeypatch.setattr(packed_module, "_trial_pays", exact_only)
    policy = lora_policy_with_random_adapters(tiny_model)
    texts = ("What is 2 + 2?", "Hi", "A longer prompt with more words", "Two and two")
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    results = []
    for mode in (False, "auto"):
        levers = GenerationSettings(custom_decode=custom_decode, packed_weights=mode)
        gen = HFGenerator(policy, tokenizer, max_new_tokens=12, generation_settings=levers)
        torch.manual_seed(0)
        results.append(gen.generate(prompts, 4))
    for plain_group, packed_group in zip(*results, strict=True):
        for a, b in zip(plain_group, packed_group, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit for bit


def test_an_unknown_mode_names_the_config_key():
    with pytest.raises(ValueError, match=r"^perf\.generate\.packed_weights must be one of auto, True, False"):
        GenerationSettings(packed_weights="yes")
