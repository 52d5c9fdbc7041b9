"""The plan's generation term bounds what one HF decode really takes: measured in a fresh process (the peak RSS
of the call above the RSS before it: Linux's VmHWM, reset just before the call through /proc/self/clear_refs), at
a group of 1,024 samples on the tiny model, where the [rows, vocab] logits dominate. Measured here about 7.0
[rows, vocab] float32 arrays (app/memory.py DECODE_STEP_LOGIT_COPIES)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lightning.app.memory import DECODE_STEP_LOGIT_COPIES

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, torch
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.models.sources import PackagedGGUFSource, RandomSource
torch.set_num_threads(1)
rows, new_tokens = int(sys.argv[1]), int(sys.argv[2])
model, tokenizer = RandomSource(tokenizer_source=PackagedGGUFSource()).load(torch.float32)
engine = HFGenerator(model, tokenizer, max_new_tokens=new_tokens, batch_size=16)
prefix = tokenizer("What is 2 + 2?", add_special_tokens=False)["input_ids"]
def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current RSS
before = status("VmRSS")
engine.generate([prefix], rows)
after = status("VmHWM")
config = model.config
print(json.dumps({"delta": after - before, "vocab": config.vocab_size, "layers": config.num_hidden_layers,
                  "kv_width": config.num_key_value_heads * (config.hidden_size // config.num_attention_heads),
                  "prompt": len(prefix)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_one_decode_call_stays_within_the_generation_term():
    rows, new_tokens = 1024, 8
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE, str(rows), str(new_tokens)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600, check=True).stdout  # fmt: skip
    m = json.loads(out.strip().splitlines()[-1])
    kv = rows * (m["prompt"] + new_tokens) * 2 * m["layers"] * m["kv_width"] * 4
    term = kv + rows * m["vocab"] * 4 * DECODE_STEP_LOGIT_COPIES  # app/memory.py's generation term
    one_array = rows * m["vocab"] * 4
    assert m["delta"] <= term * 1.05, (m["delta"] / one_array, "arrays measured")
    assert m["delta"] >= term * 0.75, (m["delta"] / one_array, "arrays measured: the constant overstates")
