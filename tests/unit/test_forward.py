"""Training-forward levers (accel/completion_forward.py) equal the plain path: log-probs, logits and gradients."""

import pytest
import torch

from grpo_lightning.accel import completion_forward as forward
from grpo_lightning.accel.completion_forward import completion_logits_and_logprobs, length_runs, shared_prompts
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.types import Rollout
from tests.helpers import lora_policy_with_random_adapters


@pytest.fixture
def policy(tiny_model):
    return lora_policy_with_random_adapters(tiny_model).train()


def make_batch(pad_id: int, groups=((7, 3), (12, 3)), seed: int = 0):
    """Groups of rollouts sharing a prompt (prompt length, group size), completions of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for gid, (prompt_len, size) in enumerate(groups):
        prompt = torch.randint(10, 1000, (prompt_len,), generator=gen).tolist()
        for k in range(size):
            length = int(torch.randint(1, 9, (1,), generator=gen))
            completion = torch.randint(10, 1000, (length,), generator=gen).tolist()
            rollouts.append(Rollout(prompt, completion, [0.0] * length, 0.0, gid, False, branch_point=k % 2))
    return collate_rollouts(rollouts, pad_id)


def run(policy, batch, **kwargs):
    policy.zero_grad()
    logits, logp = completion_logits_and_logprobs(policy, batch, 0.7, **kwargs)
    (logp * batch.completion_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logits, logp.detach() * batch.sequence_mask, grads


PLAIN = {"with_logits": True, "share_prefix": False, "chunk_tokens": None, "by_length": False}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"with_logits": True, "share_prefix": True, "chunk_tokens": None, "by_length": False},  # prefix sharing
        {"with_logits": False, "share_prefix": False, "chunk_tokens": 5, "by_length": False},  # chunked head
        {"with_logits": True, "share_prefix": False, "chunk_tokens": None, "by_length": True},  # runs by length
        {"with_logits": False, "share_prefix": True, "chunk_tokens": 7, "by_length": True},  # all (the default)
        {"with_logits": True, "share_prefix": True, "chunk_tokens": 256, "by_length": True},  # logits for probes
    ],
)
def test_levers_equal_the_plain_path(policy, tokenizer, kwargs):
    batch = make_batch(tokenizer.pad_token_id)
    plain_logits, plain_logp, plain_grads = run(policy, batch, **PLAIN)
    logits, logp, grads = run(policy, batch, **kwargs)
    assert torch.allclose(logp, plain_logp, atol=1e-5)
    padding = ~batch.sequence_mask.bool()
    assert completion_logits_and_logprobs(policy, batch, 0.7, **kwargs)[1][padding].eq(0).all()  # 0 on padding
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.allclose(g, plain_grads[name], atol=1e-5, rtol=1e-4), name
    if kwargs["with_logits"]:
        mask = batch.sequence_mask.bool()
        assert torch.allclose(logits[mask], plain_logits[mask], atol=1e-5)
    else:
        assert logits is None


@pytest.mark.parametrize("share_prefix", [False, True])
def test_several_runs_by_length_equal_the_plain_path(policy, tokenizer, monkeypatch, share_prefix):
    """With calls costed at 0 tokens every distinct length is its own run: the split and the re-ordering."""
    monkeypatch.setattr(forward, "RUN_CALL_COST_TOKENS", 0)
    batch = make_batch(tokenizer.pad_token_id, groups=((7, 4), (12, 3)), seed=3)
    assert len(forward.length_runs(forward.completion_lengths(batch))) >= 3
    _, plain_logp, plain_grads = run(policy, batch, **PLAIN)
    kwargs = {"with_logits": False, "share_prefix": share_prefix, "chunk_tokens": 4, "by_length": True}
    _, logp, grads = run(policy, batch, **kwargs)
    assert torch.allclose(logp, plain_logp, atol=1e-5)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, plain_grads[name], atol=1e-5, rtol=1e-4), name


def test_reference_under_disabled_adapter_matches(policy, tokenizer):
    batch = make_batch(tokenizer.pad_token_id)
    with torch.no_grad(), policy.disable_adapter():
        _, plain = completion_logits_and_logprobs(policy, batch, 1.0, **PLAIN)
        _, fast = completion_logits_and_logprobs(policy, batch, 1.0, with_logits=False)
    assert torch.allclose(plain * batch.sequence_mask, fast * batch.sequence_mask, atol=1e-5)


def test_shared_prompts_groups_rows_by_prompt_block(tokenizer):
    batch = make_batch(tokenizer.pad_token_id, groups=((5, 2), (9, 3), (5, 1)))
    first, inverse = shared_prompts(batch)
    assert inverse.tolist()[:2] == [inverse[0]] * 2 and len(set(inverse.tolist())) == 3
    assert all(int(inverse[f]) == u for u, f in enumerate(first.tolist()))
    distinct = make_batch(tokenizer.pad_token_id, groups=((5, 1), (6, 1)))
    assert shared_prompts(distinct) is None  # nothing shared: the plain forward


def test_module_uses_the_levers_and_gives_observers_the_same_logprobs(policy, tokenizer):
    from grpo_lightning.accel.completion_forward import completion_logprobs_with_entropy
    from grpo_lightning.algorithm.losses import GRPOLoss
    from grpo_lightning.training.module import GRPOModule, LRSchedule

    module = GRPOModule(policy, None, GRPOLoss(), optimizer=None, schedule=LRSchedule(), total_steps=1)
    batch = make_batch(tokenizer.pad_token_id)
    logits, logp = module.policy_forward(policy, batch)
    assert logits is None  # not asked for: no [B, C, V] logits
    logp_obs, terms = completion_logprobs_with_entropy(policy, batch, 1.0, batch.completion_mask)
    assert torch.equal(logp, logp_obs)  # an observer leaves the training log-probs bitwise unchanged
    assert terms.entropy.shape == batch.completion_ids.shape


def brute_force_runs_cost(lengths, call_cost):
    """Cheapest cost over EVERY set partition of the rows (not only contiguous runs of the sorted rows)."""

    def partitions(items):
        if not items:
            yield []
            return
        head, rest = items[0], items[1:]
        for part in partitions(rest):
            for i in range(len(part)):
                yield part[:i] + [[head, *part[i]]] + part[i + 1 :]
            yield [[head], *part]

    return min(
        sum(len(p) * max(lengths[i] for i in p) + call_cost for p in part)
        for part in partitions(list(range(len(lengths))))
    )


@pytest.mark.parametrize("call_cost", [0, 3, 32, 1000])
def test_length_runs_is_the_cheapest_partition(call_cost):
    gen = torch.Generator().manual_seed(call_cost)
    for n in range(1, 8):
        lengths = torch.randint(1, 130, (n,), generator=gen).tolist()
        runs = length_runs(lengths, call_cost)
        assert sorted(r for rows, _ in runs for r in rows) == list(range(n))  # every row exactly once
        assert all(length == max(lengths[r] for r in rows) for rows, length in runs)
        cost = sum(len(rows) * length + call_cost for rows, length in runs)
        assert cost == brute_force_runs_cost(lengths, call_cost)


def test_length_runs_hand_cases():
    assert length_runs([128, 13, 128, 44], 32) == [([1, 3], 44), ([0, 2], 128)]  # 2*44 + 2*128 + 64 < 4*128 + 32
    assert length_runs([128, 121, 128, 84], 32) == [([3], 84), ([1, 0, 2], 128)]  # 84 + 3*128 + 64 < 4*128 + 32
    assert length_runs([5, 5, 5], 32) == [([0, 1, 2], 5)]
    assert length_runs([1, 100], 1000) == [([0, 1], 100)]  # a call costs more than the padding it saves


@pytest.mark.parametrize(
    "levers",
    [
        {"share_prefix": False, "chunk_tokens": None, "by_length": False},
        {"share_prefix": True, "chunk_tokens": 7, "by_length": True},
    ],
    ids=["plain", "levers"],
)
def test_entropy_bonus_gradient_equals_autograd_of_the_token_mean_entropy(policy, tokenizer, levers):
    """`EntropyTerms.gradient_surrogate` (what `loss.entropy_coef` backpropagates through): its gradient equals
    autograd's of the masked token-mean entropy, computed in float64 from the plain path's full logits."""
    from grpo_lightning.accel.completion_forward import completion_logprobs_with_entropy

    batch, temperature = make_batch(tokenizer.pad_token_id), 0.7
    mask = batch.completion_mask
    policy.zero_grad()
    logits, _ = completion_logits_and_logprobs(policy, batch, temperature, **PLAIN)  # [B, C, V], already / T
    log_p = torch.log_softmax(logits.double(), -1)
    entropy = -(log_p.exp() * log_p).sum(-1)  # [B, C]
    ((entropy * mask).sum() / mask.sum()).backward()
    truth = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    _, terms = completion_logprobs_with_entropy(policy, batch, temperature, mask, **levers, with_grad=True)
    (terms.gradient_surrogate() / mask.sum()).backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert grads.keys() == truth.keys() and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, truth[name], rtol=1e-4, atol=1e-9, msg=name)
    real = mask.bool()
    torch.testing.assert_close(terms.entropy[real], entropy.detach()[real], rtol=1e-6, atol=1e-8)


def test_one_backbone_call_per_forward_whatever_the_rows(policy, tokenizer, monkeypatch):
    """`ForwardSettings.one_backbone_call` (what a sharded policy trains with, trainer=fsdp): the backbone runs once,
    where the default levers run it once per distinct prompt and per run of similar lengths, a number that depends
    on the rows; the log-probs are the same."""
    from grpo_lightning.accel import ForwardSettings

    monkeypatch.setattr(forward, "RUN_CALL_COST_TOKENS", 0)
    batch = make_batch(tokenizer.pad_token_id, groups=((7, 4), (12, 3)), seed=3)
    backbone, _ = forward.backbone_and_head(policy)
    calls = []
    backbone.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)

    def forward_with(levers: ForwardSettings) -> tuple[torch.Tensor, int]:  # log-probs [B, C], backbone calls
        calls.clear()
        _, logp = completion_logits_and_logprobs(
            policy, batch, 0.7, False, levers.share_prefix, levers.logits_chunk_tokens, levers.runs_by_length
        )
        return logp.detach(), len(calls)

    default_logp, default_calls = forward_with(ForwardSettings())
    one_logp, one_calls = forward_with(ForwardSettings().one_backbone_call())
    assert default_calls >= 3 and one_calls == 1
    assert ForwardSettings().one_backbone_call().logits_chunk_tokens == ForwardSettings().logits_chunk_tokens
    assert torch.allclose(one_logp, default_logp, atol=1e-5)
