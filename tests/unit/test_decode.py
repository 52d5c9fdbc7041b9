"""Our decode loop (accel/decode_loop.py): the sampler against brute force and frequencies, the cache against HF's."""

import copy

import pytest
import torch

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.decode_loop import PreallocatedLayer, new_cache, sample_inverse_cdf
from grpo_lightning.generation.hf import HFGenerator
from tests.helpers import lora_policy_with_random_adapters


def brute_force_index(probs: list[float], u: float) -> int:
    """The first index whose running sum exceeds u * total (a plain Python loop)."""
    total, running = sum(probs), 0.0
    for i, p in enumerate(probs):
        running += p
        if running > u * total:
            return i
    return len(probs) - 1


def test_inverse_cdf_picks_the_brute_force_index():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(7, 11, generator=gen) ** 3  # unnormalised rows
    probs[:, 4] = 0.0
    uniform = torch.rand(7, generator=gen, dtype=torch.float64)
    got = sample_inverse_cdf(probs, uniform).tolist()
    expected = [brute_force_index(row.double().tolist(), float(u)) for row, u in zip(probs, uniform, strict=True)]
    assert got == expected
    # the edges: u = 0 takes the first non-zero entry, u -> 1 the last non-zero one
    row = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert sample_inverse_cdf(row, torch.tensor([0.0], dtype=torch.float64)).item() == 1
    assert sample_inverse_cdf(row, torch.tensor([1.0 - 1e-12], dtype=torch.float64)).item() == 3


def test_inverse_cdf_frequencies_match_the_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625])
    n = 200_000
    draws = sample_inverse_cdf(probs.expand(n, -1).contiguous())
    freq = torch.bincount(draws, minlength=6).double() / n
    stderr = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert freq[2] == 0  # a zero-probability token is never drawn
    assert torch.all((freq - probs.double()).abs() <= 5 * stderr + 1e-12), freq


def test_preallocated_layer_holds_what_concatenation_holds():
    gen = torch.Generator().manual_seed(0)
    layer = PreallocatedLayer(capacity=9)
    chunks = [torch.randn(2, 3, n, 4, generator=gen) for n in (5, 1, 1, 2)]
    for chunk in chunks:
        keys, values = layer.update(chunk, -chunk)
    expected = torch.cat(chunks, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert layer.get_seq_length() == 9
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys, expected.repeat_interleave(2, dim=0))
    with pytest.raises(RuntimeError, match="capacity"):
        layer.update(chunks[1].repeat_interleave(2, 0), chunks[1].repeat_interleave(2, 0))


def test_new_cache_preallocates_full_attention_models_only(tiny_model):
    cache = new_cache(tiny_model, 32)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    sliding = copy.deepcopy(tiny_model.config)
    sliding.layer_types = ["sliding_attention"] * sliding.num_hidden_layers
    sliding.sliding_window = 8

    class Stub:
        config = sliding

    assert not any(isinstance(layer, PreallocatedLayer) for layer in new_cache(Stub(), 32).layers)


@pytest.fixture(scope="module")
def policy(tiny_model):
    return lora_policy_with_random_adapters(tiny_model)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (7, 0.9)])
def test_loop_with_warpers_samples_what_generate_samples(policy, tokenizer, top_k, top_p):
    """HF's top-k / top-p warpers in HF's order: the multinomial draw reproduces `generate` token for token."""
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "A longer prompt with more words")]
    results = []
    for custom_decode in (False, True):
        levers = GenerationSettings(custom_decode=custom_decode, sampler="multinomial")
        gen = HFGenerator(
            policy,
            tokenizer,
            max_new_tokens=10,
            temperature=0.8,
            top_k=top_k,
            top_p=top_p,
            generation_settings=levers,
        )
        torch.manual_seed(3)
        results.append(gen.generate(prompts, 3))
    for plain_group, loop_group in zip(*results, strict=True):
        for a, b in zip(plain_group, loop_group, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_unknown_sampler_names_the_key():
    with pytest.raises(ValueError, match=r"^perf\.generate\.sampler must be one of"):
        GenerationSettings(sampler="gumbel")


def test_sampling_on_cuda_excludes_cudnn_attention_and_restores_the_flags():
    """cuDNN's attention builds a graph per new shape (every decode step): the engine samples without it on CUDA,
    keeps PyTorch's other backends, and leaves the process's flags as it found them; on the CPU nothing changes."""
    from grpo_lightning.accel.decode_loop import attention_backends_for_decoding

    def flags() -> tuple[bool, ...]:
        c = torch.backends.cuda
        return c.cudnn_sdp_enabled(), c.flash_sdp_enabled(), c.mem_efficient_sdp_enabled(), c.math_sdp_enabled()

    before = flags()
    assert before[0], "PyTorch enables cuDNN attention by default"
    with attention_backends_for_decoding(torch.device("cpu")):
        assert flags() == before
    with attention_backends_for_decoding(torch.device("cuda")):
        assert flags() == (False, True, True, True)
    assert flags() == before


def test_the_hf_engine_samples_inside_the_attention_choice(tiny_model, tokenizer, monkeypatch):
    import contextlib

    import grpo_lightning.generation.hf_engine as hf
    from grpo_lightning.generation.hf import HFGenerator

    devices = []

    def recording(device):
        devices.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(hf, "attention_backends_for_decoding", recording)
    HFGenerator(tiny_model, tokenizer, max_new_tokens=3).generate([[1, 2, 3]], 2)
    assert devices == [torch.device("cpu")]


@pytest.mark.parametrize("greedy", [False, True])
def test_finished_rows_leave_the_batch_without_changing_any_row(tiny_model, tokenizer, greedy):
    """Truth: the same loop keeping every row to the end (`compact=False`). With one token in 12 an EOS, rows
    finish at many different steps, so the batch is cut several times; each row's tokens are the same and its
    log-probs agree to float32 rounding (a row's logits come from a batch of another size)."""
    from grpo_lightning.accel.decode_loop import sample_loop
    from grpo_lightning.generation.hf_engine import left_pad

    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "A longer prompt with more words", "Hi")]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)  # [24, L]
    eos = list(range(0, len(tokenizer), 12))
    out = {}
    for compact in (False, True):
        rng = torch.Generator().manual_seed(11)
        cache = new_cache(tiny_model, ids.shape[1] + 24)
        select, cuts = cache.batch_select_indices, []
        cache.batch_select_indices = lambda keep, select=select, cuts=cuts: (cuts.append(len(keep)), select(keep))
        out[compact] = sample_loop(tiny_model, ids, mask, cache, 24, eos, tokenizer.pad_token_id, 1.0,
                                   greedy=greedy, rng=rng, compact=compact)  # fmt: skip
        if not greedy:
            assert bool(cuts) == compact and all(size < 24 for size in cuts), cuts  # cut only when allowed to
    (full_tokens, full_logprobs), (tokens, logprobs) = out[False], out[True]
    finished_at = [next((t for t, tok in enumerate(row) if tok in eos), None) for row in full_tokens.tolist()]
    if not greedy:  # the batch was cut: rows finished at several different steps, some ran to the budget
        assert len({f for f in finished_at if f is not None}) >= 4 and None in finished_at
    assert torch.equal(tokens, full_tokens)
    for row, end in enumerate(finished_at):
        stop = full_tokens.shape[1] if end is None else end + 1  # up to and with the EOS; after it: pad, log-prob 0
        assert torch.allclose(logprobs[row, :stop], full_logprobs[row, :stop], atol=1e-4)
        assert torch.all(tokens[row, stop:] == tokenizer.pad_token_id) and torch.all(logprobs[row, stop:] == 0)
