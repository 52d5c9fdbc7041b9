"""GPU path (marker `gpu`, deselected by default; `make test-gpu`): end-to-end runs with trainer=gpu, HF engine.

tests/test_vllm_gpu.py holds the vLLM engine's GPU tests; tests/README.md says how to run both on a CUDA machine.
"""

import copy
import time

import pytest
import torch

from grpo_lightning.app.train import build_run
from tests.conftest import make_cfg

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_tiny_run_on_gpu(tiny_cfg):
    """The policy trains and samples on the GPU. Seen during training: Lightning's single-device teardown moves the
    module back to the CPU when `fit` returns."""
    import lightning as L

    class Devices(L.Callback):
        seen: set[str] = set()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.add(next(pl_module.policy.parameters()).device.type)

    run = build_run(tiny_cfg("trainer=gpu", "trainer.max_epochs=2", "trainer.enable_progress_bar=false"))
    devices = Devices()
    run.trainer.callbacks.append(devices)
    metrics = run.fit()
    assert devices.seen == {"cuda"}
    assert metrics["rollout/logp_diff_mean"] < 5e-2  # bf16 autocast in training vs fp32 sampling


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpu_run(tmp_path, strategy):
    """trainer=ddp / trainer=fsdp on two GPUs (nccl) through the CLI; tests/test_fsdp.py holds both to each other
    on the CPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable, "-m", "grpo_lightning", f"hydra.run.dir={tmp_path}", f"trainer={strategy}",
            "trainer.devices=2", "model=tiny", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
            "~reward.terms.gsm8k", "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
            "eval.num_problems=4", "trainer.accelerator=gpu",
        ],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@needs_cuda
def test_embedded_model_two_rounds_in_bf16_within_the_estimate(tmp_path):
    """The embedded SmolLM2-135M, two rounds with trainer=gpu in bfloat16 (evaluation on): prints the time and
    the peak GPU memory, which must stay under the plan's estimate for the trainer's GPU (an upper bound)."""
    cfg = make_cfg(tmp_path, ["trainer=gpu", "model.dtype=bfloat16", "trainer.max_epochs=2",
                              "trainer.enable_progress_bar=false", "eval.num_problems=16"])  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run = build_run(cfg)
    metrics = run.fit()
    seconds, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
    estimate = sum(t.bytes for t in run.plan.memory.trainer_gpu)
    print(f"embedded bf16, 2 rounds on {torch.cuda.get_device_name()}: {seconds:.1f} s, peak GPU memory "
          f"{peak / 2**30:.2f} GiB (estimate {estimate / 2**30:.2f} GiB)")  # fmt: skip
    assert peak <= estimate
    assert 0.0 <= metrics["eval/gsm8k_accuracy"] <= 1.0
    assert metrics["rollout/logp_diff_mean"] < 0.1  # sampled and scored by the same bf16 policy


@needs_cuda
def test_evaluation_in_a_one_process_nccl_group(tiny_cfg, tmp_path):
    """A real NCCL default group of one process (what vLLM's engine creates on CUDA): evaluation must compute."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        metrics = build_run(tiny_cfg("trainer=gpu", "trainer.max_epochs=1", "eval.num_problems=4")).fit()
    finally:
        dist.destroy_process_group()
    assert 0.0 <= metrics["eval/gsm8k_accuracy"] <= 1.0


@needs_cuda
def test_overlapped_rounds_on_gpu_sample_the_sequential_rollouts_at_lr0(tiny_cfg):
    """rollout.max_staleness=1 on a GPU: the engine copy samples on a CUDA stream of its own beside training and,
    at lr=0, samples exactly what sequential rounds sample (tests/test_overlap.py's truth on the CPU)."""
    from tests.test_overlap import run_and_record

    sequential, _, _ = run_and_record(tiny_cfg, "trainer=gpu", "data.dynamic_sampling.enabled=false")
    overlapped, _, run = run_and_record(
        tiny_cfg, "trainer=gpu", "data.dynamic_sampling.enabled=false", "rollout.max_staleness=1"
    )
    assert run.rollout_loop.background.device.type == "cuda"
    assert overlapped.rounds == sequential.rounds
    assert overlapped.staleness[1:] == [1.0] * (len(overlapped.staleness) - 1)


# ---- decode steps replayed from CUDA graphs (accel/graph_decode.py) -------------------------------------------------
GRAPH_PROMPTS = ("What is 2 + 2?", "A longer prompt with more words", "Hi")


def sample_graph_prompts(model, tokenizer, samples: int, graphs: bool, share: bool = False, rng=None):
    """GRAPH_PROMPTS on the GPU, `samples` rows each (`share`: one shared prefill per prompt), 32 new tokens with
    one EOS in 12 token ids, so rows finish at many steps: through the eager loop, or through the CUDA-graph
    steps. -> tokens, log-probs [rows, T]."""
    from grpo_lightning.accel import graph_decode
    from grpo_lightning.accel.decode_loop import new_cache, sample_loop
    from grpo_lightning.accel.generation_levers import shared_prefill
    from grpo_lightning.generation.hf_engine import left_pad

    prompts = [tokenizer(t)["input_ids"] for t in GRAPH_PROMPTS]
    eos = list(range(0, len(tokenizer), 12))
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    ids, mask = ids.cuda(), mask.cuda()
    cache = new_cache(model, ids.shape[1] + 32)
    if share:
        ids, mask, cache = shared_prefill(model, ids, mask, samples, cache)
    else:
        ids, mask = ids.repeat_interleave(samples, 0), mask.repeat_interleave(samples, 0)
    steps = graph_decode.StaticSteps(model, cache, mask, 32, capture=True) if graphs else None
    return sample_loop(model, ids, mask, cache, 32, eos, tokenizer.pad_token_id, 0.9, rng=rng, steps=steps)


@needs_cuda
@pytest.mark.parametrize("share", [False, True])
def test_cuda_graph_steps_sample_what_the_eager_loop_samples(tiny_model, tokenizer, share, monkeypatch):
    """Truth: the eager loop on the same GPU, float32, the same random stream. One EOS in 12 tokens, so rows finish
    at many steps and the batch moves to smaller captured graphs. Tokens identical; log-probs within 1e-4 (the
    stated tolerance: attention over the masked capacity sums in another order)."""
    from grpo_lightning.accel import graph_decode

    model = copy.deepcopy(tiny_model).cuda().eval()
    captured = []
    real_capture = graph_decode.StaticBatch._capture

    def counting(self):
        captured.append(self.rows)
        real_capture(self)

    monkeypatch.setattr(graph_decode.StaticBatch, "_capture", counting)
    out = {}
    for graphs in (False, True):
        rng = torch.Generator(device="cuda").manual_seed(11)
        out[graphs] = sample_graph_prompts(model, tokenizer, 8, graphs, share=share, rng=rng)
    assert torch.equal(out[True][0], out[False][0])
    assert torch.allclose(out[True][1], out[False][1], atol=1e-4, rtol=0)
    assert captured[0] == 24 and len(captured) >= 2, captured  # the first batch, then smaller ones


def graph_memory_probe() -> None:
    """Run in a fresh process by the test below: six decode calls with CUDA graphs on the tiny random model (rows
    8, 12 and 16 per prompt, twice), printing for each the captures it made and the bytes allocated after it."""
    import json
    import os

    from grpo_lightning.accel import graph_decode
    from grpo_lightning.models.sources import RandomSource
    from tests.conftest import _tokenizer_source

    source = RandomSource(tokenizer_source=_tokenizer_source(os.environ["GRPO_LIGHTNING_CACHE"]), seed=0)
    model, tokenizer = source.load(torch.float32)
    model = model.cuda().eval()
    captures = []
    real_capture = graph_decode.StaticBatch._capture

    def counting(self):
        captures[-1] += 1
        real_capture(self)

    graph_decode.StaticBatch._capture = counting
    torch.manual_seed(0)
    allocated = []
    for samples in (8, 12, 16, 8, 12, 16):
        captures.append(0)
        sample_graph_prompts(model, tokenizer, samples, graphs=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    print(json.dumps({"captures": captures, "allocated": allocated}))


@needs_cuda
def test_cuda_graph_calls_keep_no_memory_after_the_first():
    """Truth: the allocator's own count of allocated bytes, in a fresh process (PyTorch recycles a pool of 32
    streams a device, so what a new stream per capture kept stops growing once a process has used them all). The
    first call may leave what lasts the process (cuBLAS's workspaces for the warm-up and capture streams); the five
    later calls, each capturing several graphs, leave nothing more. A new warm-up stream per capture kept a 32 MiB
    workspace per capture on an H200."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("GRPO_LIGHTNING_CACHE", str(Path("~/.cache/grpo_lightning").expanduser()))
    result = subprocess.run(
        [sys.executable, "-c", "from tests.test_gpu import graph_memory_probe; graph_memory_probe()"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(n >= 2 for n in probe["captures"]), probe  # every call moved to smaller graphs as rows finished
    assert probe["allocated"][1:] == [probe["allocated"][0]] * 5, probe


@needs_cuda
@pytest.mark.parametrize("merge_lora", [True, False])
def test_cuda_graph_engine_follows_the_weights_between_calls(tiny_model, tokenizer, merge_lora):
    """The HF engine with graphs (the default) against the engine without, a LoRA policy on the GPU: the same
    rollouts; then the adapters change in place (what an optimizer step does) and the next call's graphs sample
    with the new weights, not the captured ones: again the eager engine's rollouts, which differ from the first."""
    from grpo_lightning.accel import GenerationSettings
    from grpo_lightning.generation.hf import HFGenerator
    from tests.helpers import lora_policy_with_random_adapters

    policy = lora_policy_with_random_adapters(tiny_model).cuda().eval()
    prompts = [tokenizer(t)["input_ids"] for t in GRAPH_PROMPTS]

    def rollouts(graphs: bool):
        levers = GenerationSettings(cuda_graphs=graphs, merge_lora=merge_lora)
        engine = HFGenerator(policy, tokenizer, max_new_tokens=24, temperature=0.9,
                             generation_settings=levers)  # fmt: skip
        torch.manual_seed(7)
        groups = engine.generate(prompts, 4, max_new_tokens=[24, 9, 17])  # STORPO-like budgets per prefix
        return [[(c.token_ids, c.logprobs) for c in group] for group in groups]

    def same(a, b) -> None:
        for group_a, group_b in zip(a, b, strict=True):
            for (ids_a, lp_a), (ids_b, lp_b) in zip(group_a, group_b, strict=True):
                assert ids_a == ids_b
                assert torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)

    before = rollouts(True)
    same(before, rollouts(False))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    after = rollouts(True)
    same(after, rollouts(False))
    assert after != before
