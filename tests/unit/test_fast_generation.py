"""Generation levers (grpo_lightning/accel/generation_levers.py) equal plain `generate`: same tokens, same log-probs."""

import pytest
import torch

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.generation_levers import merged_lora
from grpo_lightning.generation.hf import HFGenerator
from tests.helpers import lora_policy_with_random_adapters

PLAIN = {
    "merge_lora": False,
    "share_prefill": False,
    "stream_logprobs": False,
    "custom_decode": False,
    "packed_weights": False,
}  # GenerationSettings.plain() (its sampler is unused without custom_decode)
HF_LOOP = {"custom_decode": False}  # levers inside `generate`


@pytest.fixture(scope="module")
def policy(tiny_model):
    return lora_policy_with_random_adapters(tiny_model)


def sample(policy, tokenizer, greedy=False, **levers):
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Hi", "A longer prompt with more words")]
    settings = GenerationSettings(**levers)
    gen = HFGenerator(policy, tokenizer, max_new_tokens=12, temperature=0.7, batch_size=9,
                      generation_settings=settings)  # fmt: skip
    torch.manual_seed(0)
    return gen.generate(prompts, 1 if greedy else 3, greedy=greedy)


@pytest.mark.parametrize(
    "levers",
    [
        {**HF_LOOP, "merge_lora": True, "share_prefill": False, "stream_logprobs": False},
        {**HF_LOOP, "merge_lora": False, "share_prefill": True, "stream_logprobs": False},
        {**HF_LOOP, "merge_lora": False, "share_prefill": False, "stream_logprobs": True},
        HF_LOOP,
        # our decode loop (pre-allocated cache) drawing with torch.multinomial, as `generate` does
        {"merge_lora": False, "share_prefill": False, "sampler": "multinomial"},
        {"sampler": "multinomial"},  # every lever on, the multinomial draw
    ],
)
@pytest.mark.parametrize("greedy", [False, True])
def test_levers_sample_what_the_plain_path_samples(policy, tokenizer, levers, greedy):
    plain = sample(policy, tokenizer, greedy, **PLAIN)
    fast = sample(policy, tokenizer, greedy, **levers)
    for plain_group, fast_group in zip(plain, fast, strict=True):
        for a, b in zip(plain_group, fast_group, strict=True):
            assert a.token_ids == b.token_ids and a.finished == b.finished
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_merged_lora_restores_the_base_and_computes_the_adapted_model(policy, tokenizer):
    frozen = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in frozen.items()}
    ids = torch.tensor([tokenizer("Natalia sold clips")["input_ids"]])
    policy.eval()
    with torch.no_grad():
        adapted = policy(ids).logits
        with merged_lora(policy) as merged:
            assert merged
            merged_logits = policy(ids).logits
        after = policy(ids).logits
    assert torch.allclose(merged_logits, adapted, atol=1e-5)
    assert torch.equal(after, adapted)
    for name, p in policy.named_parameters():
        if name in frozen:
            assert p is frozen[name] and torch.equal(p, before[name]), name  # same object, same bits


def test_merged_lora_leaves_a_plain_model_alone(tiny_model):
    with merged_lora(tiny_model) as merged:
        assert not merged
