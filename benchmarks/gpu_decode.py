"""HF-engine sampling on a CUDA GPU: one round's generate call, with PyTorch's own attention choice (cuDNN for
bf16 on Hopper) against the engine's (cuDNN excluded; grpo_lightning/accel/decode_loop.py), side by side.

Every call gets prompts of a length not seen before, as every training round does: cuDNN's attention builds an
execution graph per shape, so a benchmark that repeats one prompt would time cached graphs only.

    python benchmarks/gpu_decode.py                       # embedded model, bf16, 2 prompts x 8 samples x 96 tokens
    python benchmarks/gpu_decode.py --dtype float32 --calls 3
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--calls", type=int, default=2, help="generate calls per setting, each with new lengths")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. model=qwen0.5b)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_decode.py needs a CUDA device")

    import grpo_lightning.generation.hf_engine as hf
    from benchmarks.decode_precision import engine_and_prompts

    run, engine, prompts = engine_and_prompts(["trainer=gpu", f"model.dtype={args.dtype}", *args.overrides])
    run.module.policy.cuda()
    lengths = itertools.count(7, 7)

    def fresh() -> list[list[int]]:
        """The prompts with `k` filler ids inserted before their last 5 tokens (the assistant header)."""
        k = next(lengths)
        return [p[:-5] + list(range(1000, 1000 + k)) + p[-5:] for p in prompts]

    engines_choice = hf.attention_backends_for_decoding
    settings = {
        "PyTorch's attention choice": lambda device: contextlib.nullcontext(),
        "cuDNN attention excluded (the engine's)": engines_choice,
    }
    engine.generate(prompts, args.samples, 8)  # CUDA context, cuBLAS handles
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"{len(prompts)} prompts x {args.samples} samples x {args.max_new_tokens} new tokens")  # fmt: skip
    print("| attention | s per generate call (mean of", args.calls, ") | ms per decode step |")
    print("|---|---|---|")
    try:
        for name, choice in settings.items():
            hf.attention_backends_for_decoding = choice
            seconds, steps = 0.0, 0
            for _ in range(args.calls):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = engine.generate(fresh(), args.samples, args.max_new_tokens)
                torch.cuda.synchronize()
                seconds += time.perf_counter() - start
                steps += max(len(c.token_ids) for group in out for c in group)
            print(f"| {name} | {seconds / args.calls:.2f} | {seconds / steps * 1e3:.1f} |")
    finally:
        hf.attention_backends_for_decoding = engines_choice


if __name__ == "__main__":
    main()
