"""The CPU a `vllm serve` server takes while the trainer trains (it samples nothing then), beside what it takes
while it samples and while nothing runs (benchmarks/README.md, "Scaling out").

    make vllm-venv
    .venv-vllm/bin/python benchmarks/server_cpu.py                     # embedded SmolLM2-135M, LoRA, 2 rounds
    .venv-vllm/bin/python benchmarks/server_cpu.py --override model.lora.enabled=false --rounds 3

Builds the run as `python -m grpo_lightning generator=vllm_server` does (the run starts its CPU server on
127.0.0.1), then per round: the weight push, the round's rollout, its training micro-batches (policy forward and
backward, reference forward) by hand, and an idle window of the same length as the training. For each phase it
reads the CPU seconds (user + system, /proc/<pid>/stat) of every process in the server's process group (the
supervisor leads it: the API server, its engine core and workers) and of this, the trainer's, process. A server
whose CPU seconds per wall second during training are near 0 leaves the trainer its cores; near 1 or more, it
spins. Round 0 pays the server's warm-up: read the later rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_profile import train_round  # noqa: E402
from vllm_vs_hf import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(REPO / "grpo_lightning" / "conf")
TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_s(group: int) -> dict[str, float]:
    """CPU seconds (user + system) of process group `group`'s live processes: the engine core (`VLLM::EngineCore`:
    the scheduler), its model worker (`VLLM::Worker...`) and the rest (the API server; the supervisor, which
    sleeps)."""
    out = {"api": 0.0, "engine": 0.0, "worker": 0.0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group:  # fields after the command: state, ppid, pgrp, ..., utime (11), stime (12)
            kind = "worker" if comm.startswith("VLLM::Worker") else "engine" if comm.startswith("VLLM::") else "api"
            out[kind] += (int(fields[11]) + int(fields[12])) / TICKS
    return out


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def built_run(overrides: list[str], output_dir: str):
    """The run `python -m grpo_lightning <overrides>` builds (its servers started), writing into `output_dir`, and
    its rollout loop."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from grpo_lightning.app.train import build_run
    from grpo_lightning.training.rollout_loop import RolloutLoop

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = output_dir
    run = build_run(cfg)
    return run, next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))


def measure(name: str, group: int, work) -> dict:
    server, trainer, start = sum(group_cpu_s(group).values()), own_cpu_s(), time.perf_counter()
    work()
    wall = time.perf_counter() - start
    server_s, trainer_s = sum(group_cpu_s(group).values()) - server, own_cpu_s() - trainer
    return {"phase": name, "wall_s": wall, "server_cpu_s": server_s, "trainer_cpu_s": trainer_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--override", action="append", default=[], help="Hydra override (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="the run folder, kept (servers' logs in vllm_server/); default: a temporary one")
    args = parser.parse_args()

    import torch

    from grpo_lightning.training.round_layout import lay_out

    overrides = [
        "generator=vllm_server", "generator.dtype=float32", "generator.max_model_len=1024",
        "generator.lora_sync=adapter", "data.prompts_per_round=4", "variant.num_generations=8",
        "generator.max_new_tokens=64", "eval.enabled=false", "trainer.enable_progress_bar=false", *args.override,
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        run, loop = built_run(overrides, args.out or scratch)
        generator, module, dm = loop.generator, run.module, run.datamodule
        group = generator.servers[0].process.pid  # the supervisor: the leader of the server's process group
        try:
            for k in range(args.rounds):
                torch.manual_seed(k)
                rows.append(measure(f"push {k}", group, lambda: generator.sync_weights(module.policy)))
                holder = {}

                def rollout(k=k, holder=holder):
                    prompts = dm.prompts_for_round(k, loop.tokenizer)
                    variant = loop.sampler.variant
                    holder["r"] = variant.generate_rollouts(generator, prompts, loop.reward_fn, loop.decode)

                rows.append(measure(f"rollout {k}", group, rollout))
                pad = loop.tokenizer.pad_token_id
                dm.serve(lay_out(holder["r"], k, dm.micro_batches_per_round, dm.settings, pad))
                rows.append(measure(f"train {k}", group, lambda: train_round(module, dm.schedule)))
                idle_s = rows[-1]["wall_s"]
                rows.append(measure(f"idle {k}", group, lambda s=idle_s: time.sleep(s)))
        finally:
            generator.close()
    print(f"CPU: {cpu_name()}; torch threads in the trainer: {torch.get_num_threads()}")
    print(f"overrides: {' '.join(overrides)}\n")
    print("| phase | wall s | server CPU s | server cores busy | trainer CPU s |")
    print("|---|---|---|---|---|")
    for r in rows:
        busy = r["server_cpu_s"] / r["wall_s"] if r["wall_s"] > 0 else float("nan")
        print(f"| {r['phase']} | {r['wall_s']:.2f} | {r['server_cpu_s']:.2f} | {busy:.2f} | {r['trainer_cpu_s']:.2f} |")


if __name__ == "__main__":
    main()
