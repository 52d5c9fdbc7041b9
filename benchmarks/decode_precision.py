"""HF-engine sampling with the linear weights in float32, bfloat16 and int8 (`perf.generate.weights`), side by side.

    python benchmarks/decode_precision.py                       # embedded model, 2 prompts x 8 samples x 64 tokens
    python benchmarks/decode_precision.py --calls 3 --max-new-tokens 128
    python benchmarks/decode_precision.py model.lora.enabled=false
    python benchmarks/decode_precision.py --threads 1        # a machine other jobs keep busy

Builds the run as the CLI does (default config: embedded SmolLM2-135M, LoRA policy, perf=cpu_fast), then for each
precision times one generate call (best of `--calls`, each with the same prompts and seed; the low-precision copies
are made inside the call and counted) and compares the engine's log-probs of the tokens it sampled with the float32
policy's, teacher-forced (one forward of prompt + completion): that gap is what the trainer's
`rollout/logp_diff_mean` measures and what the stale-weight guard (`generator.logp_diff_threshold`) watches.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
]
PRECISIONS = ("float32", "bfloat16", "int8")


def engine_and_prompts(overrides: list[str]):
    """A run built from `overrides` (as the CLI composes them), its HF engine, and QUESTIONS as chat prompts
    (token ids) in the engine's tokenizer; benchmarks/gpu_decode.py uses it too."""
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg

    run = build_run(make_cfg(Path(tempfile.mkdtemp()), overrides))
    engine = run.callbacks["rollout_loop"].generator
    tok = engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]  # fmt: skip
    return run, engine, [tok(chat)["input_ids"] for chat in chats]


def policy_logprobs(model, prefix: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The float32 policy's log_softmax(logits / T) of each completion token, teacher-forced."""
    ids = torch.tensor([prefix + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2, help="generate calls per precision; the best is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a loaded "
                        "machine 1 thread avoids OpenMP threads waiting for each other")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. model.lora.enabled=false)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from benchmarks.vllm_vs_hf import cpu_name
    from grpo_lightning.accel import GenerationSettings

    run, engine, prompts = engine_and_prompts(list(args.overrides))
    cfg = run.cfg
    policy = run.module.policy.eval()  # no dropout in the teacher-forced forward
    temperature = engine.sampling.temperature
    base_settings = engine.generation_settings
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"{len(prompts)} prompts x {args.samples} samples x {args.max_new_tokens} new tokens, T={temperature}, "
          f"best of {args.calls} calls; LoRA: {cfg.model.lora.enabled}")  # fmt: skip
    print("| weights | s per call | tokens/s | vs float32 | mean abs log-prob gap | max abs log-prob gap |")
    print("|---|---|---|---|---|---|")
    baseline = None
    try:
        for weights in PRECISIONS:
            levers = {f.name: getattr(base_settings, f.name) for f in dataclasses.fields(GenerationSettings)}
            engine.generation_settings = GenerationSettings(**{**levers, "weights": weights})
            best, samples = float("inf"), None
            for _ in range(args.calls):
                torch.manual_seed(0)
                start = time.perf_counter()
                samples = engine.generate(prompts, args.samples, args.max_new_tokens)
                best = min(best, time.perf_counter() - start)
            tokens = sum(len(c.token_ids) for group in samples for c in group)
            gaps = torch.cat([
                (torch.tensor(c.logprobs) - policy_logprobs(policy, prefix, c.token_ids, temperature)).abs()
                for prefix, group in zip(prompts, samples, strict=True)
                for c in group
            ])  # fmt: skip
            rate = tokens / best
            baseline = baseline or rate
            print(f"| {weights} | {best:.2f} | {rate:.0f} | {rate / baseline:.2f}x | {gaps.mean():.2e} | "
                  f"{gaps.max():.2e} |")  # fmt: skip
    finally:
        engine.generation_settings = base_settings


if __name__ == "__main__":
    main()
