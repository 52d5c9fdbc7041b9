"""The fused in-place LoRA forward (grpo_lightning/accel/fused_lora.py) against peft's own forward."""

import copy

import pytest
import torch

from grpo_lightning.accel import fused_lora as lora_forward
from grpo_lightning.accel.fused_lora import install_fused_lora_forward, remove_fused_lora_forward
from grpo_lightning.accel.generation_levers import merged_lora
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from tests.helpers import lora_policy_with_random_adapters


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, 1000, (3, 11), generator=gen)  # [B, T]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # a left-padded row
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def logits_and_grads(policy, inputs):
    policy.zero_grad(set_to_none=True)
    logits = policy(**inputs).logits  # [B, T, V]
    (logits.float().pow(2).mean() + logits[:, -1, 7].sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.fixture
def policies(tiny_model):
    peft_policy = lora_policy_with_random_adapters(tiny_model).train()
    fused = copy.deepcopy(peft_policy)
    assert install_fused_lora_forward(fused) > 0
    return peft_policy, fused


def test_fused_forward_equals_peft_with_the_same_gradients(policies, monkeypatch):
    peft_policy, fused = policies
    inputs = batch()
    plain_logits, plain_grads = logits_and_grads(peft_policy, inputs)
    fused_calls = []
    check = lora_forward._plain_lora_adapter
    monkeypatch.setattr(
        lora_forward, "_plain_lora_adapter", lambda *a: fused_calls.append(check(*a)) or fused_calls[-1]
    )
    logits, grads = logits_and_grads(fused, inputs)
    assert fused_calls and all(name == "default" for name in fused_calls)  # every LoRA layer took the fused path
    assert torch.allclose(logits, plain_logits, atol=1e-5)
    assert grads.keys() == plain_grads.keys() and any("lora_A" in n for n in grads)
    for name, g in grads.items():
        assert torch.allclose(g, plain_grads[name], atol=1e-6, rtol=1e-4), name


def test_disabled_and_merged_adapters_run_peft_forward_bit_for_bit(policies):
    peft_policy, fused = policies
    inputs = batch(1)
    with torch.no_grad():
        with peft_policy.disable_adapter():
            expected = peft_policy(**inputs).logits
        with fused.disable_adapter():
            assert torch.equal(fused(**inputs).logits, expected)  # the reference: the base model, unchanged
        with merged_lora(peft_policy):
            expected = peft_policy(**inputs).logits
        with merged_lora(fused):
            assert torch.equal(fused(**inputs).logits, expected)


def test_dropout_and_autocast_fall_back_to_peft(tiny_model):
    peft_policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4, alpha=8, dropout=0.1), True)
    peft_policy.train()
    fused = copy.deepcopy(peft_policy)
    install_fused_lora_forward(fused)
    inputs = batch(2)
    for context in (torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad()):
        with context:
            torch.manual_seed(0)
            expected = peft_policy(**inputs).logits
            torch.manual_seed(0)
            assert torch.equal(fused(**inputs).logits, expected)  # the same dropout masks: the same code ran


def test_remove_restores_peft_forward(policies):
    peft_policy, fused = policies
    remove_fused_lora_forward(fused)
    inputs = batch(3)
    with torch.no_grad():
        assert torch.equal(fused(**inputs).logits, peft_policy(**inputs).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_autocast_without_dropout_runs_peft_forward(policies, dtype):
    """trainer.precision=bf16-mixed / 16-mixed on CPU: plain LoRA (no dropout) under CPU autocast must not take
    the fused path (its addmm_ would mix half-precision and fp32 operands) and computes what peft computes."""
    peft_policy, fused = policies
    inputs = batch(4)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = peft_policy(**inputs).logits
        assert torch.equal(fused(**inputs).logits, expected)
