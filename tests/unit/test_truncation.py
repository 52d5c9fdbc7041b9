"""Top-k / top-p: the kept set against a brute-force definition and HF's warpers, the trainer's log-probs (every
path of the LM head) against a float64 reference, and the HF engine's reported log-probs against the trainer's,
so that the importance ratio is 1 on-policy (algorithm/truncation.py)."""

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from grpo_lightning.accel import GenerationSettings
from grpo_lightning.accel.chunked_head import HeadLogprobs, chunked_logprobs
from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.hf_engine import sampled_logprobs
from grpo_lightning.training.module import GRPOModule, LRSchedule
from grpo_lightning.types import Rollout

SETTINGS = [(5, 1.0), (0, 0.8), (7, 0.9), (0, 0.3), (1, 1.0), (50, 0.95)]


def brute_force_kept(row: list[float], top_k: int, top_p: float) -> set[int]:
    """The kept set from the definitions, one token at a time in float64: the k largest logits (ties at the k-th
    kept), then, in descending probability of the distribution renormalised over those, each token while the mass
    of the tokens before it is below p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = [i for i in order if not top_k or row[i] >= row[order[min(top_k, len(row)) - 1]]]
    total = sum(math.exp(row[i]) for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += math.exp(row[i]) / total
    return set(nucleus)


@pytest.mark.parametrize(("top_k", "top_p"), SETTINGS)
def test_the_kept_set_is_the_brute_force_one_and_hf_warpers_one(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(40, 60, generator=gen) * 3  # [N, V], no ties
    dropped = Truncation(top_k, top_p).dropped(logits)
    for row in range(logits.shape[0]):
        kept = set((~dropped[row]).nonzero().squeeze(-1).tolist())
        assert kept == brute_force_kept(logits[row].double().tolist(), top_k, top_p)
    hf = logits.clone()
    if top_k:
        hf = TopKLogitsWarper(top_k=top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p=top_p)(None, hf)
    assert torch.equal(torch.isinf(hf), dropped)


def test_log_probs_by_hand():
    # top-k 2 of logits (0, 1, 2): tokens 1 and 2, renormalised
    got = Truncation(top_k=2).log_probs(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([1]))
    assert got.item() == pytest.approx(1 - math.log(math.e + math.e**2), abs=1e-6)
    # top-p 0.5 of three equal logits: cumulative 1/3, 2/3, 1 keeps two of them (1/2 each); the third, named,
    # joins them (1/3)
    got = [Truncation(top_p=0.5).log_probs(torch.zeros(1, 3), torch.tensor([t])).item() for t in range(3)]
    assert sorted(got) == pytest.approx([math.log(1 / 3), math.log(1 / 2), math.log(1 / 2)], abs=1e-6)
    # a token outside the set is kept when named (weights that moved since it was sampled): finite
    outside = Truncation(top_k=1).log_probs(torch.tensor([[0.0, 3.0]]), torch.tensor([0]))
    assert outside.item() == pytest.approx(0.0 - math.log(1 + math.e**3), abs=1e-6)
    assert Truncation().log_probs(torch.tensor([[0.0, 3.0]]), torch.tensor([0])).item() == pytest.approx(
        outside.item(), abs=1e-6
    )  # top-k 1 plus the named token is the whole vocabulary of 2 here


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="top_k >= 0"):
        Truncation(top_k=-1)
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        Truncation(top_p=0.0)


def float64_truncated_logprobs(hidden, weight, bias, index, temperature, truncation):
    """The reference: truncated log-softmax of float64 logits, differentiable by autograd."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature  # [n, V]
    drop = torch.tensor(
        [
            [i not in brute_force_kept(r, truncation.top_k, truncation.top_p) for i in range(len(r))]
            for r in logits.tolist()
        ]
    )
    drop[torch.arange(len(index)), index] = False
    logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, index[:, None]).squeeze(-1)


@pytest.mark.parametrize(("top_k", "top_p"), [(4, 1.0), (0, 0.7), (6, 0.8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_head_path_scores_the_truncated_distribution_with_its_gradient(top_k, top_p, with_bias):
    gen = torch.Generator().manual_seed(top_k)
    truncation = Truncation(top_k, top_p)
    hidden = torch.randn(9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(17, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(17, generator=gen, dtype=torch.float64) if with_bias else None
    index = torch.randint(0, 17, (9,), generator=gen)  # some outside the kept set: kept as the sampled token
    upstream = torch.randn(9, generator=gen, dtype=torch.float64)
    expected = float64_truncated_logprobs(hidden, weight, bias, index, 0.7, truncation)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), hidden)
    assert torch.isfinite(expected).all()

    fused = HeadLogprobs.apply(hidden, weight, bias, index, 0.7, None, truncation)  # frozen head
    (fused_grad,) = torch.autograd.grad((fused * upstream).sum(), hidden)
    assert torch.allclose(fused.double(), expected, atol=1e-5)
    assert torch.allclose(fused_grad, expected_grad, atol=1e-5)

    head = torch.nn.Linear(8, 17, bias=with_bias).double()
    with torch.no_grad():
        head.weight.copy_(weight)
        if with_bias:
            head.bias.copy_(bias)
    recomputed = chunked_logprobs(hidden, head, index, 0.7, chunk_tokens=4, truncation=truncation)  # trainable
    (recomputed_grad,) = torch.autograd.grad((recomputed * upstream).sum(), hidden)
    assert torch.allclose(recomputed.double(), expected, atol=1e-5)
    assert torch.allclose(recomputed_grad, expected_grad, atol=1e-5)
    without = chunked_logprobs(hidden, head, index, 0.7, chunk_tokens=4)
    assert (without.double() < expected - 1e-3).all()  # the full distribution: log S < 0 at every token


def test_sampled_logprobs_of_generate_are_the_truncated_ones():
    logits = (torch.tensor([[0.0, 2.0, 4.0]]), torch.tensor([[2.0, 2.0, 2.0]]))  # T = 2 halves them
    got = sampled_logprobs(logits, torch.tensor([[1, 0]]), 2.0, Truncation(top_k=2))
    # step 1: tokens 1 and 2 kept; step 2: three tokens tie at the 2nd largest logit, all kept
    assert got[0].tolist() == pytest.approx([1 - math.log(math.e + math.e**2), math.log(1 / 3)], abs=1e-6)


@pytest.mark.parametrize(
    "levers",
    [
        GenerationSettings(),  # our decode loop
        GenerationSettings(custom_decode=False),  # HF generate, log-probs recorded step by step
        GenerationSettings(custom_decode=False, stream_logprobs=False),  # HF generate, its own logits
    ],
    ids=["decode loop", "generate, streamed", "generate, output logits"],
)
def test_the_trainer_scores_what_the_hf_engine_reports(tiny_model, tokenizer, levers):
    """On-policy the importance ratio is 1 at every token: the engine's log-probs are the trainer's. Scoring the
    full distribution instead is off by log S, the kept mass, at every token."""
    top_k, top_p, temperature = 12, 0.8, 0.9
    generator = HFGenerator(
        tiny_model,
        tokenizer,
        max_new_tokens=10,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generation_settings=levers,
    )
    torch.manual_seed(0)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Name a colour")]
    groups = generator.generate(prompts, num_samples=3)
    rollouts = [
        Rollout(prompt, c.token_ids, c.logprobs, 0.0, g, truncated=not c.finished)
        for g, (prompt, group) in enumerate(zip(prompts, groups, strict=True))
        for c in group
    ]
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
    mask = batch.completion_mask.bool()

    def scored(**truncation) -> torch.Tensor:
        module = GRPOModule(tiny_model, None, GRPOLoss(), None, LRSchedule(), 1, temperature=temperature, **truncation)
        with torch.no_grad():
            return module.completion_logprobs(tiny_model, batch)[mask]

    engine = batch.gen_logprobs[mask]
    assert (scored(top_k=top_k, top_p=top_p) - engine).abs().max() < 1e-4
    assert (scored() - engine).mean() < -0.05  # log S: the kept mass is below 1
