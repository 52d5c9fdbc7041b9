"""`HeadLogprobs` (accel/chunked_head.py): value and gradient against log_softmax + gather under autograd."""

import pytest
import torch

from grpo_lightning.accel.chunked_head import HeadLogprobs, chunked_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_value_and_hidden_gradient_equal_autograd(temperature, with_bias):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(13, generator=gen, dtype=torch.float64) if with_bias else None
    index = torch.randint(0, 13, (6,), generator=gen)
    upstream = torch.randn(6, generator=gen, dtype=torch.float64)

    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    expected = torch.log_softmax(logits, dim=-1).gather(-1, index[:, None]).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), hidden)

    got = HeadLogprobs.apply(hidden, weight, bias, index, temperature)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), hidden)
    # float32 inside (the logits are taken in float32 whatever the model dtype)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.allclose(got_grad, expected_grad, atol=1e-5)


def test_chunked_logprobs_takes_the_fused_path_only_for_a_frozen_head():
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    index = torch.randint(0, 11, (2, 5), generator=gen)
    reference = torch.log_softmax(head(hidden) / 0.9, dim=-1).gather(-1, index[..., None]).squeeze(-1)
    head.weight.requires_grad_(False)
    frozen = chunked_logprobs(hidden, head, index, 0.9, chunk_tokens=3)
    assert frozen.grad_fn is not None and "HeadLogprobs" in type(frozen.grad_fn).__name__ or frozen.requires_grad
    assert torch.allclose(frozen, reference, atol=1e-6)
    head.weight.requires_grad_(True)  # a trainable head: checkpointed recompute, weight gradient flows
    trained = chunked_logprobs(hidden, head, index, 0.9, chunk_tokens=3)
    trained.sum().backward()
    assert head.weight.grad is not None and torch.allclose(trained, reference, atol=1e-6)
