"""MKL-packed linear layers for generation (grpo_lightning/generation/packed.py) against F.linear."""

import pytest
import torch
from torch import nn

from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.packed import packed_linears, packing_available
from tests.helpers import lora_policy_with_random_adapters

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no MKL packed GEMM")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_equal_f_linear_bit_for_bit_for_any_rows(bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.Linear(160, 40, bias=bias))
    inputs = [torch.randn(16, 96), torch.randn(3, 96), torch.randn(16, 1, 96), torch.randn(2, 7, 96)]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
        with packed_linears(model, rows=16) as packed:
            assert packed == 2
            got = [model(x) for x in inputs]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    assert all("forward" not in layer.__dict__ for layer in model)  # nn.Linear.forward again


def test_grad_inputs_and_other_dtypes_are_left_to_f_linear():
    torch.manual_seed(0)
    layer, half = nn.Linear(32, 8), nn.Linear(32, 8).to(torch.bfloat16)
    x = torch.randn(4, 32, requires_grad=True)
    with packed_linears(nn.ModuleList([layer, half]), rows=4) as packed:
        assert packed == 1  # the bf16 layer is not packed
        layer(x).sum().backward()  # a gradient still flows: F.linear ran
    assert torch.allclose(x.grad, layer.weight.sum(0).expand(4, 32))


@pytest.mark.parametrize("custom_decode", [True, False])
def test_generation_with_packed_weights_is_identical(tiny_model, tokenizer, custom_decode):
    policy = lora_policy_with_random_adapters(tiny_model)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Hi", "A longer prompt with more words")]
    results = []
    for packed in (False, True):
        gen = HFGenerator(
            policy, tokenizer, num_generations=3, max_new_tokens=12, custom_decode=custom_decode, packed_weights=packed
        )
        torch.manual_seed(0)
        results.append(gen.generate(prompts, 3))
    for plain_group, packed_group in zip(*results, strict=True):
        for a, b in zip(plain_group, packed_group, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit for bit
