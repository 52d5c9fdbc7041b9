"""HF generator: log-prob gather against hand values and against an independent full forward pass."""

import math

import pytest
import torch

from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.hf_engine import left_pad, sampled_logprobs


def test_sampled_logprobs_match_hand_values():
    # Two steps, vocab 3, one row; temperature 2 halves the logits.
    logits = (torch.tensor([[0.0, 2.0, 4.0]]), torch.tensor([[2.0, 2.0, 2.0]]))
    tokens = torch.tensor([[1, 0]])
    got = sampled_logprobs(logits, tokens, temperature=2.0, truncation=Truncation())
    z = math.exp(0) + math.exp(1) + math.exp(2)
    expected = [1 - math.log(z), math.log(1 / 3)]
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_token_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize(
    ("key", "kwargs"),
    [
        ("max_new_tokens", {"max_new_tokens": 0}),
        ("temperature", {"temperature": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
    ],
)
def test_sampling_config_names_the_bad_key(key, kwargs):
    with pytest.raises(ValueError, match=f"generator.{key}"):
        SamplingConfig(**kwargs)


def test_generated_logprobs_equal_a_full_forward(tiny_model, tokenizer):
    """The log-probs generate reports equal those of one forward over prompt + completion (no cache)."""
    torch.manual_seed(0)
    gen = HFGenerator(tiny_model, tokenizer, max_new_tokens=12, temperature=0.7)
    prompts = [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Hi")["input_ids"]]
    samples = gen.generate(prompts, num_samples=3)
    assert [len(s) for s in samples] == [3, 3]
    for prompt, completions in zip(prompts, samples, strict=True):
        for c in completions:
            assert 1 <= len(c.token_ids) <= 12
            assert len(c.logprobs) == len(c.token_ids)
            if c.finished:
                assert c.token_ids[-1] in gen.eos_token_ids
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = tiny_model(ids).logits[0, len(prompt) - 1 : -1] / 0.7  # [C, V]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def test_generation_stops_at_eos_and_marks_truncation(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer, max_new_tokens=4)
    samples = gen.generate([tokenizer("abc")["input_ids"]], num_samples=2, max_new_tokens=4)
    for c in samples[0]:
        eos_positions = [i for i, t in enumerate(c.token_ids) if t in gen.eos_token_ids]
        assert eos_positions in ([], [len(c.token_ids) - 1])  # at most one EOS, and only at the end
        assert c.finished == bool(eos_positions)
        assert c.finished or len(c.token_ids) == 4


def test_per_prefix_budgets_cap_each_prefix(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer, max_new_tokens=10, batch_size=2)
    prompts = [tokenizer("one")["input_ids"], tokenizer("two two")["input_ids"], tokenizer("three")["input_ids"]]
    samples = gen.generate(prompts, num_samples=2, max_new_tokens=[3, 7, 1])
    for budget, completions in zip([3, 7, 1], samples, strict=True):
        assert len(completions) == 2
        assert all(1 <= len(c.token_ids) <= budget and len(c.logprobs) == len(c.token_ids) for c in completions)


def test_bad_budgets_are_rejected(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="budgets for 2 prefixes"):
        gen.generate([[1], [2]], 2, max_new_tokens=[3])
    with pytest.raises(ValueError, match=">= 1"):
        gen.generate([[1]], 2, max_new_tokens=[0])


def test_auto_batch_size_samples_sixteen_rows_a_call_on_a_cpu(tiny_model, tokenizer, monkeypatch):
    """generator.batch_size=auto (the default) on a CPU model: 16 rows a call (2 prompts of 8 samples), as a
    number 16 does; a number is kept. Counted at the call the decode makes."""
    calls = []
    for batch_size, expected in (("auto", 16), (16, 16), (8, 8)):
        gen = HFGenerator(tiny_model, tokenizer, max_new_tokens=2, batch_size=batch_size)
        real = gen._generate_chunk
        monkeypatch.setattr(gen, "_generate_chunk", lambda p, *a, real=real: calls.append(len(p)) or real(p, *a))
        assert gen.rows_per_call_now() == expected
        calls.clear()
        gen.generate([[5, 6], [7, 8], [9, 10], [11, 12], [13, 14]], 8)
        assert calls == [expected // 8] * (5 // (expected // 8)) + [5 % (expected // 8)] * bool(5 % (expected // 8))
    with pytest.raises(ValueError, match="generator.batch_size must be an integer >= 1 or auto"):
        HFGenerator(tiny_model, tokenizer, batch_size="all")
