"""Where a server round's time goes, against an in-process round: the same prompts, seeds and sampling through
`generator=vllm_server` (the run's own `vllm serve` on 127.0.0.1) and through `generator=vllm` (vLLM in the
training process), one engine after the other in one invocation (benchmarks/README.md, "Scaling out").

    make vllm-venv
    .venv-vllm/bin/python benchmarks/server_round.py --rounds 3
    .venv-vllm/bin/python benchmarks/server_round.py --engines server --override generator.lora_sync=adapter

Per round and engine: the weight push and the rollout (`variant.generate_rollouts`, what a round samples), each
with its wall time and the CPU seconds (user + system, /proc) of the trainer's process and, for the server, of its
API server (HTTP, JSON, tokenizer and detokenizer) and its engine core (scheduling, the model) apart. For the
server, every HTTP request the trainer sends is counted by route with its summed wall time (they overlap: one
thread per request), and the cost of a connection is measured alone: `GET /health` with a new connection per
request (urllib, as the generator sends them) against one kept-alive connection. Round 0 pays warm-up: read the
later rounds.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_cpu import built_run, group_cpu_s, own_cpu_s  # noqa: E402
from vllm_vs_hf import cpu_name  # noqa: E402

ENGINES = {
    "server": ["generator=vllm_server"],
    "vllm": ["generator=vllm", "+generator.engine_kwargs.enforce_eager=true"],
}


class RequestTally:
    """Every request the trainer's `ServerClient`s send: count and summed wall time by route."""

    def __init__(self) -> None:
        self.count: dict[str, int] = defaultdict(int)
        self.wall_s: dict[str, float] = defaultdict(float)

    def install(self) -> None:
        from grpo_lightning.generation.vllm.server_weights import ServerClient

        send, tally = ServerClient.request, self

        def timed(client, method, path, body=None, timeout_s=None):
            start = time.perf_counter()
            try:
                return send(client, method, path, body, timeout_s)
            finally:
                route = f"{method} {path.split('?')[0]}"
                tally.count[route] += 1
                tally.wall_s[route] += time.perf_counter() - start

        ServerClient.request = timed

    def take(self) -> dict[str, tuple[int, float]]:
        out = {route: (self.count[route], self.wall_s[route]) for route in self.count}
        self.count.clear()
        self.wall_s.clear()
        return out


def connection_cost(url: str, requests: int) -> tuple[float, float]:
    """Median ms of `GET /health`: a new connection per request (urllib), and one kept-alive connection."""
    fresh = []
    for _ in range(requests):
        start = time.perf_counter()
        with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
            answer.read()
        fresh.append(time.perf_counter() - start)
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    kept = []
    for _ in range(requests):
        start = time.perf_counter()
        connection.request("GET", "/health")
        connection.getresponse().read()
        kept.append(time.perf_counter() - start)
    connection.close()
    return 1e3 * statistics.median(fresh), 1e3 * statistics.median(kept)


def run_engine(engine: str, args: argparse.Namespace, tally: RequestTally) -> list[dict]:
    import torch

    overrides = [
        *ENGINES[engine], "generator.dtype=float32", "generator.max_model_len=1024",
        f"data.prompts_per_round={args.prompts}", f"variant.num_generations={args.generations}",
        f"generator.max_new_tokens={args.max_new_tokens}", "eval.enabled=false", "trainer.enable_progress_bar=false",
        *args.override,
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run, loop = built_run(overrides, tmp)
        generator, module, dm = loop.generator, run.module, run.datamodule
        group = generator.servers[0].process.pid if engine == "server" else None  # the supervisor leads the group

        def measure(phase: str, k: int, work) -> dict:
            server = group_cpu_s(group) if group else {"api": 0.0, "engine": 0.0, "worker": 0.0}
            trainer, start = own_cpu_s(), time.perf_counter()
            result = work()
            wall = time.perf_counter() - start
            after = group_cpu_s(group) if group else server
            row = {
                "engine": engine, "phase": phase, "round": k, "wall_s": wall, "trainer_cpu_s": own_cpu_s() - trainer,
                **{f"{kind}_cpu_s": after[kind] - server[kind] for kind in server},
                "requests": tally.take() if group else {},
            }  # fmt: skip
            if result is not None:
                row["tokens"] = result
            rows.append(row)
            return row

        try:
            tally.take()
            for k in range(args.rounds):
                torch.manual_seed(k)
                measure("push", k, lambda: generator.sync_weights(module.policy))
                generator.reseed(k)

                def rollout(k=k):
                    prompts = dm.prompts_for_round(k, loop.tokenizer)
                    rollouts = loop.sampler.variant.generate_rollouts(generator, prompts, loop.reward_fn, loop.decode)
                    return sum(len(r.completion_ids) for r in rollouts)

                measure("rollout", k, rollout)
            if group and args.connections:
                fresh, kept = connection_cost(generator.pool.live[0].url, args.connections)
                rows.append({"engine": engine, "phase": "connection", "fresh_ms": fresh, "kept_ms": kept})
        finally:
            generator.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--connections", type=int, default=200, help="requests timed per connection kind (0: off)")
    parser.add_argument("--override", action="append", default=[], help="Hydra override (repeatable)")
    args = parser.parse_args()

    tally = RequestTally()
    tally.install()
    load_before = os.getloadavg()[0]
    rows = [row for engine in args.engines for row in run_engine(engine, args, tally)]
    import torch

    print(f"CPU: {cpu_name()}; torch threads in the trainer: {torch.get_num_threads()}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(f"{args.prompts} prompts x {args.generations} samples x {args.max_new_tokens} new tokens; "
          f"overrides: {' '.join(args.override) or '(none)'}\n")  # fmt: skip
    print("| engine | phase | round | wall s | tokens/s | trainer CPU s | API server CPU s | engine core CPU s "
          "| worker CPU s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["phase"] == "connection":
            continue
        rate = f"{r['tokens'] / r['wall_s']:.0f}" if "tokens" in r else ""
        cpu = " | ".join(f"{r[f'{kind}_cpu_s']:.2f}" for kind in ("trainer", "api", "engine", "worker"))
        print(f"| {r['engine']} | {r['phase']} | {r['round']} | {r['wall_s']:.2f} | {rate} | {cpu} |")
    later = [r for r in rows if r["phase"] == "rollout" and r["round"] > 0]
    for engine in args.engines:
        walls = [r["wall_s"] for r in later if r["engine"] == engine]
        if walls:
            print(f"\n{engine}: rollout median over rounds 1..: {statistics.median(walls):.2f} s")
    served = [r for r in rows if r["engine"] == "server" and r.get("requests")]
    if served:
        print("\nRequests the trainer sent to the server, rounds 1.. (count, summed wall s):")
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for r in served:
            if r["round"] > 0:
                for route, (count, wall) in r["requests"].items():
                    totals[f"{r['phase']}: {route}"][0] += count
                    totals[f"{r['phase']}: {route}"][1] += wall
        for route, (count, wall) in sorted(totals.items()):
            print(f"- {route}: {count}, {wall:.3f} s")
    for r in rows:
        if r["phase"] == "connection":
            print(f"\nGET /health, median of {args.connections}: a new connection each {r['fresh_ms']:.2f} ms, "
                  f"one kept-alive connection {r['kept_ms']:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
