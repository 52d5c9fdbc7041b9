"""Scale-out engines on the embedded model, one invocation: the HF engine, vLLM in every training process
(`generator=vllm`) and `vllm serve` servers (`generator=vllm_server`), at 1 and 2 training processes, with LoRA
and with full fine-tuning.

    make vllm-venv
    .venv-vllm/bin/python benchmarks/scale_out.py                   # every arm, 4 rounds each
    .venv-vllm/bin/python benchmarks/scale_out.py --arms server-lora-1 vllm-lora-1 --rounds 3

Each arm runs the real CLI (`python -m grpo_lightning`, embedded SmolLM2-135M, float32, evaluation off) in its own
process, one after the other, with the same seed and prompts; dynamic sampling off, so every round samples
exactly its prompts once. From each run's TensorBoard log it reads, per round,
the rollout time, the generated tokens, the train time and the weight push before sampling
(`time/weight_sync_s`), and reports medians over the rounds after the first (round 0 pays the engines' warm-up)
beside the start-up. Round = sync + rollout + train. Targets checked in the last lines: the server's round <=
1.15x in-process vLLM's, a LoRA sync <= 5% of a round, a full 135M sync <= 1 s. Writes a Markdown table to
stdout and, with --json, the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_vs_hf import cpu_name, scalars  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENGINE = {
    "hf": ["generator=hf"],
    "vllm": ["generator=vllm", "generator.dtype=float32", "generator.max_model_len=1024",
             "+generator.engine_kwargs.enforce_eager=true"],
    "server": ["generator=vllm_server", "generator.dtype=float32", "generator.max_model_len=1024"],
}  # fmt: skip
SYNC = {
    "lora": {"hf": [], "vllm": [], "server": ["generator.lora_sync=adapter"]},
    "full": {"hf": ["model.lora.enabled=false"], "vllm": ["model.lora.enabled=false"],
             "server": ["model.lora.enabled=false"]},
}  # fmt: skip
PROCESSES = {1: [], 2: ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]}
ARMS = [f"{engine}-{sync}-{n}" for engine in ENGINE for sync in SYNC for n in PROCESSES]


def run_arm(arm: str, args: argparse.Namespace, out: Path) -> dict:
    import subprocess

    engine, sync, n = arm.split("-")
    overrides = [
        *ENGINE[engine], *SYNC[sync][engine], *PROCESSES[int(n)],
        f"trainer.max_epochs={args.rounds}", f"data.prompts_per_round={args.prompts}",
        f"variant.num_generations={args.generations}", f"generator.max_new_tokens={args.max_new_tokens}",
        "eval.enabled=false", "data.dynamic_sampling.enabled=false", "trainer.enable_progress_bar=false",
        f"hydra.run.dir={out}", *args.override,
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "grpo_lightning", *overrides], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"scale_out_failed_{arm}"
        shutil.copytree(out, kept, dirs_exist_ok=True)  # the run folder, servers' logs included
        raise SystemExit(f"{arm} failed (run folder kept in {kept}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    s = scalars(out)
    later = slice(1, None)
    rollout_s, train_s, sync_s = s["time/rollout_s"][later], s["time/train_s"][later], s["time/weight_sync_s"][later]
    tokens = [t * r for t, r in zip(s["rollout/tokens_per_s"][later], rollout_s, strict=True)]
    rounds = [a + b + c for a, b, c in zip(sync_s, rollout_s, train_s, strict=True)]
    return {
        "arm": arm,
        "overrides": overrides,
        "wall_s": wall,
        "startup_s": wall - sum(s["time/rollout_s"]) - sum(s["time/train_s"]) - sum(s["time/weight_sync_s"]),
        "round_s": statistics.median(rounds),
        "rollout_s": statistics.median(rollout_s),
        "train_s": statistics.median(train_s),
        "sync_s": statistics.median(sync_s),
        "tokens_per_s": statistics.median(t / r for t, r in zip(tokens, rollout_s, strict=True)),
        "logp_diff_mean": s["rollout/logp_diff_mean"][-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS)
    parser.add_argument("--prompts", type=int, default=4, help="data.prompts_per_round")
    parser.add_argument("--generations", type=int, default=4, help="variant.num_generations")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="trainer.max_epochs (medians skip round 0)")
    parser.add_argument("--override", nargs="*", default=[], help="more CLI overrides, for every arm")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args()

    rows = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="scale_out_") as tmp:
        for arm in args.arms:
            rows[arm] = run_arm(arm, args, Path(tmp) / arm)
            r = rows[arm]
            print(f"{arm}: round {r['round_s']:.2f} s, sync {r['sync_s']:.3f} s", file=sys.stderr, flush=True)
    shape = f"{args.prompts} prompts x {args.generations} samples x {args.max_new_tokens} new tokens"
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"CPU: {cpu_name()}; {shape}; {args.rounds} rounds, medians over rounds 1..{args.rounds - 1}; {load}\n")
    print("| engine | sync | processes | round s | rollout s | rollout tokens/s | train s | weight sync s | "
          "sync / round | start-up s | logp_diff_mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, r in rows.items():
        engine, sync, n = arm.split("-")
        print(
            f"| {engine} | {sync} | {n} | {r['round_s']:.2f} | {r['rollout_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['train_s']:.2f} | {r['sync_s']:.3f} | {r['sync_s'] / r['round_s']:.1%} | {r['startup_s']:.0f} | "
            f"{r['logp_diff_mean']:.2g} |"
        )
    print()
    for sync in SYNC:
        for n in PROCESSES:
            server, vllm = rows.get(f"server-{sync}-{n}"), rows.get(f"vllm-{sync}-{n}")
            if server and vllm:
                ratio = server["round_s"] / vllm["round_s"]
                print(f"- {sync}, {n} process(es): server round / in-process vLLM round = {ratio:.2f} (target <= 1.15)")
    for arm, r in rows.items():
        if arm.startswith("server-lora"):
            print(f"- {arm}: LoRA sync {r['sync_s'] / r['round_s']:.1%} of a round (target <= 5%)")
        if arm.startswith("server-full"):
            print(f"- {arm}: full 135M sync {r['sync_s']:.2f} s (target <= 1 s)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "shape": shape, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
