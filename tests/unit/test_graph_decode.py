"""The static-buffer decode step that CUDA graphs replay (accel/graph_decode.py), run eagerly on the CPU, against
today's decode loop (`EagerSteps`): the same tokens from the same random stream, log-probs to float32 rounding.
Its replay from CUDA graphs is tested on a GPU (tests/test_gpu.py)."""

import logging

import pytest
import torch

import grpo_lightning.accel.graph_decode as graph_decode
from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.decode_loop import new_cache, sample_loop
from grpo_lightning.accel.generation_levers import shared_prefill
from grpo_lightning.accel.graph_decode import StaticSteps, bucket
from grpo_lightning.accel.hf_internals import DynamicCache
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.hf_engine import left_pad
from tests.helpers import lora_policy_with_random_adapters

PROMPTS = ("What is 2 + 2?", "A longer prompt with more words", "Hi")  # three lengths: left padding differs
NEW = 24


def decode(model, tokenizer, kind, *, share, greedy=False, eos_every=12, samples=8, cache=None):
    """One call of the decode loop over PROMPTS x `samples`, with `kind` steps: "eager" (`EagerSteps`) or
    "static" (`StaticSteps`, not captured). EOS is one token in `eos_every`, so rows finish at many steps and the
    batch shrinks several times. Returns tokens, log-probs and the sizes of the static batches it went through."""
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    cache = cache if cache is not None else new_cache(model, ids.shape[1] + NEW)
    if share:
        ids, mask, cache = shared_prefill(model, ids, mask, samples, cache)
    else:
        ids, mask = ids.repeat_interleave(samples, 0), mask.repeat_interleave(samples, 0)
    steps = StaticSteps(model, cache, mask, NEW, capture=False) if kind == "static" else None
    sizes = []
    if steps is not None:
        real_logits = steps.logits

        def recording(ids, positions):
            out = real_logits(ids, positions)
            if steps.batch is not None and (not sizes or sizes[-1] != steps.batch.rows):
                sizes.append(steps.batch.rows)
            return out

        steps.logits = recording
    eos = list(range(0, len(tokenizer), eos_every))
    rng = torch.Generator().manual_seed(11)
    tokens, logprobs = sample_loop(
        model, ids, mask, cache, NEW, eos, tokenizer.pad_token_id, 0.9, greedy=greedy, rng=rng, steps=steps
    )
    return tokens, logprobs, sizes


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("greedy", [False, True])
def test_static_steps_sample_what_the_eager_loop_samples(tiny_model, tokenizer, share, greedy):
    """Truth: the eager loop. The static step attends over the whole capacity with the unwritten columns masked;
    the tokens are the same, the log-probs agree to float32 rounding. With `share`, the first static step is
    the prompt's last token (the cache already holds the rest); without, the first is the eager prefill."""
    eager_tokens, eager_logprobs, _ = decode(tiny_model, tokenizer, "eager", share=share, greedy=greedy)
    tokens, logprobs, sizes = decode(tiny_model, tokenizer, "static", share=share, greedy=greedy)
    assert torch.equal(tokens, eager_tokens)
    assert torch.allclose(logprobs, eager_logprobs, atol=1e-5, rtol=0)
    if not greedy:  # rows finished at many steps: the batch moved to smaller power-of-two buffers
        assert sizes[0] == 24 and len(sizes) >= 2 and all(b < a for a, b in zip(sizes, sizes[1:], strict=False))
        assert all(s & (s - 1) == 0 for s in sizes[1:]), sizes


def test_static_steps_with_a_lora_policy(tiny_model, tokenizer):
    """peft's LoRA forward (adapters unmerged) through the static step: same tokens as the eager loop."""
    policy = lora_policy_with_random_adapters(tiny_model).eval()
    eager = decode(policy, tokenizer, "eager", share=True, eos_every=7)
    static = decode(policy, tokenizer, "static", share=True, eos_every=7)
    assert torch.equal(static[0], eager[0])
    assert torch.allclose(static[1], eager[1], atol=1e-5, rtol=0)


def test_a_cache_that_is_not_preallocated_decodes_eagerly_logged_once(tiny_model, tokenizer, caplog, monkeypatch):
    """A model whose layers are not all full attention gets HF's DynamicCache: the static path steps aside, with
    one warning per process, and the tokens are the eager loop's bit for bit."""
    monkeypatch.setattr(graph_decode, "_logged", set())
    eager = decode(tiny_model, tokenizer, "eager", share=False, cache=DynamicCache(config=tiny_model.config))
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.accel.graph_decode"):
        for _ in range(2):
            tokens, logprobs, sizes = decode(
                tiny_model, tokenizer, "static", share=False, cache=DynamicCache(config=tiny_model.config)
            )
    assert sizes == [] and torch.equal(tokens, eager[0]) and torch.equal(logprobs, eager[1])
    warnings = [r for r in caplog.records if "perf.generate.cuda_graphs" in r.getMessage()]
    assert len(warnings) == 1 and "full attention" in warnings[0].getMessage()


def test_a_failed_capture_falls_back_to_the_eager_loop(tiny_model, tokenizer, caplog, monkeypatch):
    """A capture that raises (as one does on an operation that syncs with the host): the call goes on eagerly from
    the same cache, and its tokens and log-probs are the eager loop's."""
    monkeypatch.setattr(graph_decode, "_logged", set())

    def failing_capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph_decode.StaticBatch, "_capture", failing_capture)
    real_adopt = StaticSteps._adopt

    def adopt_captured(self):
        batch = real_adopt(self)
        batch.capture = True  # what the engine asks for on CUDA
        return batch

    monkeypatch.setattr(StaticSteps, "_adopt", adopt_captured)
    eager = decode(tiny_model, tokenizer, "eager", share=True)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.accel.graph_decode"):
        tokens, logprobs, _ = decode(tiny_model, tokenizer, "static", share=True)
    assert torch.equal(tokens, eager[0]) and torch.allclose(logprobs, eager[1], atol=1e-6, rtol=0)
    assert any("capturing the decode step failed" in r.getMessage() for r in caplog.records)


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 128]


def test_the_cuda_graphs_key_does_nothing_on_a_cpu(tiny_model, tokenizer):
    """`perf.generate.cuda_graphs` is on by default and the CPU engine ignores it: the same rollouts bit for bit."""
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    out = []
    for graphs in (True, False):
        levers = GenerationSettings(cuda_graphs=graphs)
        engine = HFGenerator(tiny_model, tokenizer, max_new_tokens=12, generation_settings=levers)
        torch.manual_seed(5)
        out.append([[(c.token_ids, c.logprobs) for c in group] for group in engine.generate(prompts, 4)])
    assert out[0] == out[1]
    assert GenerationSettings().cuda_graphs and not GenerationSettings.plain().cuda_graphs


def test_cuda_graphs_key_names_itself():
    with pytest.raises(ValueError, match=r"perf\.generate\.cuda_graphs"):
        GenerationSettings(cuda_graphs="yes")
