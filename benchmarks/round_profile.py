"""Time and measure one round of grpo_lightning on the embedded model, phase by phase (benchmarks/README.md).

    GRPO_LIGHTNING_CACHE=/tmp/glcache python benchmarks/round_profile.py               # rollout + train, RSS
    python benchmarks/round_profile.py --profile                                       # + torch.profiler top ops
    python benchmarks/round_profile.py --override model.dtype=bfloat16 --repeat 2

Builds the run exactly as `python -m grpo_lightning` does (same config, overrides appended), then runs the
round-0 rollout and the training micro-batches (policy forward + backward, reference forward) by hand, with
wall time and the process RSS (current and peak) after every phase. Numbers are for one process on a shared
machine: compare settings within one invocation (`--compare` runs each override set in its own subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import compose  # noqa: E402


def rss_gb() -> tuple[float, float]:
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            vals[key] = int(value.split()[0]) / 1024**2
    return vals["VmRSS"], vals["VmHWM"]


def train_round(module, schedule) -> None:
    """One round's training work by hand: policy forward + backward and reference forward per micro-batch."""
    module.policy.train()
    for batch in schedule:
        _, logp = module.policy_forward(module.policy, batch)
        ref = module.reference_logprobs(batch)
        out = module.loss_fn(logp, logp.detach(), ref, batch.advantages, batch.completion_mask)
        (out.loss / len(schedule)).backward()
    module.policy.zero_grad(set_to_none=True)


def profile_round(overrides: list[str], repeat: int, profile: bool) -> dict:
    import torch

    from grpo_lightning.app.train import build_run
    from grpo_lightning.training.rollout_loop import RolloutLoop
    from grpo_lightning.training.round_layout import lay_out

    result: dict = {"overrides": overrides, "phases": []}

    def mark(name: str, start: float) -> None:
        now, peak = rss_gb()
        result["phases"].append({"phase": name, "s": time.perf_counter() - start, "rss_gb": now, "peak_gb": peak})

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cfg = compose(tmp, 1, overrides)
        run = build_run(cfg)
        module, dm = run.module, run.datamodule
        rollout_cb = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
        mark("build", start)
        prof = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            if profile
            else contextlib.nullcontext()
        )
        with prof:
            for it in range(repeat):
                torch.manual_seed(it)
                start = time.perf_counter()
                prompts = dm.prompts_for_round(it, rollout_cb.tokenizer)
                rollouts = rollout_cb.sampler.variant.generate_rollouts(
                    rollout_cb.generator, prompts, rollout_cb.reward_fn, rollout_cb.decode
                )
                mark(f"rollout{it}", start)
                pad = rollout_cb.tokenizer.pad_token_id
                dm.serve(lay_out(rollouts, it, dm.micro_batches_per_round, dm.settings, pad))
                start = time.perf_counter()
                train_round(module, dm.schedule)
                mark(f"train{it}", start)
                lengths = [len(r.completion_ids) for r in rollouts]
                prompt_lengths = [len(r.prompt_ids) for r in rollouts]
                result.setdefault("completion_len", []).append(sum(lengths) / len(lengths))
                result.setdefault("prompt_len", []).append(sum(prompt_lengths) / len(prompt_lengths))
        if profile:
            result["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--override", action="append", default=[], help="Hydra override (repeatable)")
    parser.add_argument("--compare", action="append", default=[], help="a space-separated override set; repeat")
    parser.add_argument("--repeat", type=int, default=1, help="rounds to run (round 0's prompts, then 1, ...)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops by self CPU time")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.compare:
        results = []
        for spec in args.compare:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--repeat", str(args.repeat), "--json", f.name]
                for o in spec.split():
                    cmd += ["--override", o]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                r = json.loads(Path(f.name).read_text())
            results.append(r)
            print(f"\n{' '.join(r['overrides']) or '(defaults)'}", flush=True)
            for p in r["phases"]:
                print(
                    f"  {p['phase']:<10} {p['s']:7.2f} s   rss {p['rss_gb']:.2f} GB   peak {p['peak_gb']:.2f} GB",
                    flush=True,
                )
        return
    result = profile_round(args.override, args.repeat, args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
        return
    for p in result["phases"]:
        print(f"{p['phase']:<10} {p['s']:7.2f} s   rss {p['rss_gb']:.2f} GB   peak {p['peak_gb']:.2f} GB")
    print("completion len", result["completion_len"], "prompt len", result["prompt_len"])
    if args.profile:
        print(result["profile"])


if __name__ == "__main__":
    main()
