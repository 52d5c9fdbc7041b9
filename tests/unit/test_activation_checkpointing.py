"""perf.forward.activation_checkpointing (accel/activation_checkpointing.py): the same log-probs and gradients as
keeping every activation, far fewer bytes saved for the backward, and the rule that excludes prefix sharing.

Truths: the forward without checkpointing (log-probs bitwise, gradients to float rounding) and the bytes autograd
itself packs for the backward (`torch.autograd.graph.saved_tensors_hooks`), counted per storage.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lightning.accel import ForwardSettings
from grpo_lightning.accel.activation_checkpointing import enable_activation_checkpointing
from grpo_lightning.accel.completion_forward import completion_logits_and_logprobs
from tests.helpers import lora_policy_with_random_adapters
from tests.unit.test_forward import make_batch

GPU_FORWARD = {"with_logits": False, "share_prefix": False, "chunk_tokens": 16, "by_length": False}  # perf=gpu's


def _step(policy, batch, **levers):
    """(log-probs [B, C], gradients by name, bytes saved for the backward) of one loss on the batch."""
    policy.zero_grad()
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, logp = completion_logits_and_logprobs(policy, batch, 0.7, **levers)
    (logp * batch.completion_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logp.detach(), grads, sum(saved.values())


@pytest.fixture
def lora_pair(tiny_model):
    plain = lora_policy_with_random_adapters(tiny_model).train()
    checkpointed = copy.deepcopy(plain)
    enable_activation_checkpointing(checkpointed)
    return plain, checkpointed


@pytest.mark.parametrize("levers", [GPU_FORWARD, {**GPU_FORWARD, "chunk_tokens": None, "by_length": True}])
def test_lora_gradients_equal_keeping_every_activation(lora_pair, tokenizer, levers):
    plain, checkpointed = lora_pair
    batch = make_batch(tokenizer.pad_token_id, groups=((7, 3), (12, 3)), seed=1)
    logp, grads, _ = _step(plain, batch, **levers)
    logp_ckpt, grads_ckpt, _ = _step(checkpointed, batch, **levers)
    assert torch.equal(logp_ckpt, logp)  # the forward is the same computation
    assert grads_ckpt.keys() == grads.keys() and any("lora_A" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(grads_ckpt[name], g, atol=1e-6, rtol=1e-5), name


def test_full_finetuning_gradients_equal_keeping_every_activation(tiny_model, tokenizer):
    plain = copy.deepcopy(tiny_model).train().requires_grad_(True)
    checkpointed = copy.deepcopy(plain)
    enable_activation_checkpointing(checkpointed)
    batch = make_batch(tokenizer.pad_token_id, seed=2)
    logp, grads, _ = _step(plain, batch, **GPU_FORWARD)  # a trainable head: chunks recomputed in the backward
    logp_ckpt, grads_ckpt, _ = _step(checkpointed, batch, **GPU_FORWARD)
    assert torch.equal(logp_ckpt, logp)
    assert grads_ckpt.keys() == grads.keys() and len(grads) == len(list(plain.parameters()))
    for name, g in grads.items():
        assert torch.allclose(grads_ckpt[name], g, atol=1e-6, rtol=1e-5), name


def test_checkpointed_layers_save_a_fraction_of_the_bytes(lora_pair, tokenizer):
    """Every layer's activations (about 10h + 5i + 2kv values a token) against what is saved outside the layers
    (the embeddings' output, the final norm, the chunked head's [n, H] gradient): measured, not assumed."""
    plain, checkpointed = lora_pair
    batch = make_batch(tokenizer.pad_token_id, groups=((20, 4), (24, 4)), seed=3)
    _, _, plain_bytes = _step(plain, batch, **GPU_FORWARD)
    _, _, checkpointed_bytes = _step(checkpointed, batch, **GPU_FORWARD)
    assert checkpointed_bytes * 3 < plain_bytes, (checkpointed_bytes, plain_bytes)


def test_sampling_and_scoring_ignore_the_checkpoints(lora_pair, tokenizer):
    """The layers checkpoint in training mode only: eval-mode and no-grad forwards (the engines, old and reference
    log-probs) give bitwise the plain model's log-probs, and the KV cache the decode needs is kept."""
    plain, checkpointed = lora_pair
    batch = make_batch(tokenizer.pad_token_id, seed=4)
    with torch.no_grad():
        for model in (plain, checkpointed):
            model.eval()
        expected = completion_logits_and_logprobs(plain, batch, 0.7, **GPU_FORWARD)[1]
        assert torch.equal(completion_logits_and_logprobs(checkpointed, batch, 0.7, **GPU_FORWARD)[1], expected)
        shared = {**GPU_FORWARD, "share_prefix": True}  # eval mode: the shared prompt's cache is used as before
        assert torch.allclose(completion_logits_and_logprobs(checkpointed, batch, 0.7, **shared)[1], expected,
                              atol=1e-5)  # fmt: skip


def test_checkpointing_excludes_prefix_sharing():
    with pytest.raises(ValueError, match=r"perf.forward.activation_checkpointing=true needs perf.forward.share_prefix"):
        ForwardSettings(activation_checkpointing=True)  # share_prefix defaults to true
    ForwardSettings(activation_checkpointing=True, share_prefix=False)


def test_a_model_transformers_cannot_checkpoint_is_refused_naming_the_key():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="perf.forward.activation_checkpointing=false"):
        enable_activation_checkpointing(model)
