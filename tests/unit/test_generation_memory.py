"""What sampling allocates on a CPU: the LM head's input re-laid in half precision (accel/head_input.py) and the
merge's per-layer deltas computed into reused buffers (accel/generation_levers.py `_DeltaScratch`).

Truths: the peak resident size of a fresh process (Linux's VmHWM, reset through /proc/self/clear_refs) around one
`linear` call; peft's own `get_delta_weight`, bit for bit; the plain call's logits.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_lightning.accel.generation_levers import _DeltaScratch, merged_lora
from grpo_lightning.accel.head_input import restrided_head_input
from tests.helpers import lora_policy_with_random_adapters

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, torch
from torch import nn
from grpo_lightning.accel.head_input import restrided_head_input
torch.set_num_threads(1)
class Head(nn.Module):  # the output embeddings of a causal LM, as transformers finds them
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(576, 49152, bias=False, dtype=torch.bfloat16)
    def get_output_embeddings(self):
        return self.lm_head
model = Head().requires_grad_(False)
hidden = torch.randn(16, 64, 576, dtype=torch.bfloat16)[:, -1:, :]  # what logits_to_keep=1 hands the head
def status(field):
    return int(next(x for x in open("/proc/self/status") if x.startswith(field + ":")).split()[1]) * 1024
def peak_of_one_call():
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    model.lm_head(hidden)
    return status("VmHWM") - before
plain = peak_of_one_call()
with restrided_head_input(model):
    restrided = peak_of_one_call()
print(json.dumps({"plain": plain, "restrided": restrided, "weight": 49152 * 576 * 2}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_a_sliced_half_precision_head_input_copies_no_weight_per_row():
    """16 rows of a sliced bf16 hidden state against a [49152, 576] head: the re-laid input holds less than one copy
    of the head's weight; the plain call a copy per row where the CPU's bf16 kernel makes one (torch 2.13 on an
    AVX-512 Xeon; on an AVX2-only CPU it makes none, and the test says so by skipping)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=True).stdout  # fmt: skip
    m = json.loads(out.strip().splitlines()[-1])
    assert m["restrided"] < m["weight"], m
    if m["plain"] < 8 * m["weight"]:  # the copy comes from the CPU's bf16 kernel (seen on AVX-512 Xeons, not AVX2)
        pytest.skip(f"this CPU's bf16 matmul copies no weight per row ({m}): the workaround saves nothing here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_restrided_head_gives_the_plain_logits(tiny_model, dtype):
    """The same logits as the plain call (a re-laid copy of the input); float32 is not touched at all."""
    model = copy.deepcopy(tiny_model).to(dtype)
    ids = torch.randint(10, 1000, (4, 9))
    with torch.no_grad():
        plain = model(input_ids=ids, logits_to_keep=1).logits
        with restrided_head_input(model):
            restrided = model(input_ids=ids, logits_to_keep=1).logits
    assert torch.allclose(restrided.float(), plain.float(), atol=1e-2 if dtype == torch.bfloat16 else 0.0)
    assert not model.get_output_embeddings()._forward_pre_hooks  # the hook is gone after the block


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_the_merge_deltas_are_peft_s_bit_for_bit(tiny_model, base_dtype, adapter_dtype):
    """Each layer's delta from the reused buffers equals peft's `get_delta_weight` cast to the weight's dtype, and
    the merged weights are W + that delta exactly."""
    policy = lora_policy_with_random_adapters(copy.deepcopy(tiny_model).to(base_dtype))
    for name, p in policy.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    layers = [m for m in policy.modules() if hasattr(m, "lora_A") and hasattr(m, "get_delta_weight")]
    scratch = _DeltaScratch(layers)
    expected = {}
    with torch.no_grad():
        for module in layers:
            weight = module.get_base_layer().weight
            peft_delta = module.get_delta_weight("default").to(weight.dtype)
            assert torch.equal(scratch.delta(module, "default", weight.dtype), peft_delta)
            expected[module] = weight + peft_delta
        with merged_lora(policy):
            for module in layers:
                assert torch.equal(module.get_base_layer().weight, expected[module])
