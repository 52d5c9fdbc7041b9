"""Peak memory and time of HF generate calls on a CPU: the resident size before each call, the call's peak
(Linux's VmHWM, reset through /proc/self/clear_refs just before it) and after it, with LoRA merged or not.

    python benchmarks/generate_memory.py --model Qwen/Qwen2.5-1.5B-Instruct --dtype bfloat16 --merge true
    python benchmarks/generate_memory.py --model Qwen/Qwen2.5-1.5B-Instruct --dtype bfloat16 --merge false

The model is a published architecture with random weights (models/architectures.py) wrapped in the default LoRA
adapter; each call samples `--rows` rows (2 prompts of 200 and 150 tokens, G = rows / 2) of `--new-tokens` tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_lightning.accel import GenerationSettings  # noqa: E402
from grpo_lightning.generation.hf import HFGenerator  # noqa: E402
from grpo_lightning.models.lora import LoraSettings, wrap_policy  # noqa: E402
from grpo_lightning.models.sources import ArchitectureSource  # noqa: E402

GIB = 2**30


def status(field: str) -> float:
    """A /proc/self/status size field, in GiB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024 / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct", help="a models/architectures.py name")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--merge", default="true", choices=["true", "false"], help="perf.generate.merge_lora")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = ArchitectureSource(architecture=args.model).load(getattr(torch, args.dtype))
    policy, _ = wrap_policy(model, LoraSettings(), needs_reference=False)
    settings = GenerationSettings(merge_lora=args.merge == "true")
    engine = HFGenerator(policy, tokenizer, max_new_tokens=args.new_tokens,
                         batch_size=args.rows, generation_settings=settings)  # fmt: skip
    prefix = list(range(100, 300))
    print(f"{args.model} {args.dtype}, merge_lora={args.merge}, {args.rows} rows x {args.new_tokens} tokens, "
          f"{torch.get_num_threads()} threads; loaded: {status('VmRSS'):.2f} GiB resident")  # fmt: skip
    print("| call | before GiB | peak GiB | after GiB | s |\n|---|---|---|---|---|")
    for call in range(args.calls):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from the current resident size
        before, start = status("VmRSS"), time.perf_counter()
        engine.generate([prefix, prefix[:150]], args.rows // 2)
        seconds = time.perf_counter() - start
        print(f"| {call} | {before:.2f} | {status('VmHWM'):.2f} | {status('VmRSS'):.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
