"""Does training make the model better? The learning recipe against an lr=0 control, over several seeds.

Runs `python -m grpo_lightning experiment=<recipe> seed=<s>` for every seed twice: trained, and an identical
control with `optim.optimizer.lr=0` (same rollouts, same evaluation, no update). Both evaluate greedy answers
on a fixed subset of the GSM8K test split (training draws from the train split only). Prints a per-seed table
(start, end, change of eval format rate and accuracy, and of the training reward), the trained-minus-control
gap, time-to-target, and writes `learning.md` and `learning.png` (reward and format rate per round, trained vs
control) into the output folder.

    python benchmarks/learning.py                          # experiment=learn_cpu, seeds 0 1 2
    python benchmarks/learning.py --arms trained control no_ds --seeds 0

Runs that finished before (a `final_metrics.json` in their folder) are read, not rerun: an interrupted
benchmark continues where it stopped (`--force` reruns). Arms: `trained`, `control` (lr=0) and `no_ds`
(trained without dynamic sampling, for its effect on time-to-target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grpo_lightning.app.analysis import RunData, read_run, series, time_to_target

ARMS = {
    "trained": [],
    "control": ["optim.optimizer.lr=0"],
    "no_ds": ["data.dynamic_sampling.enabled=false"],
}
ROUND_TAGS = ("train/reward_mean", "rollout/format_rate")


def run_arms(out: Path, experiment: str, arms: list[str], seed: int, extra: list[str], force: bool, parallel: bool):
    """The arms of one seed, each in `<out>/<arm>_seed<seed>` (a finished run is read, not rerun).

    `parallel`: all arms at once, one thread each. On a small CPU that is faster than one after the other with
    every thread each (a 135M model's matrices are too small to keep several threads busy), and trained and
    control then see the same machine load.
    """
    procs = []
    for arm in arms:
        run_dir = out / f"{arm}_seed{seed}"
        if (run_dir / "final_metrics.json").is_file() and not force:
            print(f"{run_dir.name}: finished before, reading it", flush=True)
            continue
        if run_dir.exists():  # an unfinished or forced run: start it over
            shutil.rmtree(run_dir)
        cmd = [sys.executable, "-m", "grpo_lightning", f"experiment={experiment}", f"seed={seed}", *ARMS[arm]]
        cmd += [*extra, f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false"]
        env = dict(os.environ, OMP_NUM_THREADS="1") if parallel else os.environ.copy()
        print(f"{run_dir.name}: {' '.join(cmd[1:])}", flush=True)
        log = open(out / f"{arm}_seed{seed}.log", "w")  # noqa: SIM115 - closed when the run ends
        procs.append((run_dir, log, time.perf_counter(), subprocess.Popen(cmd, stdout=log, stderr=log, env=env)))
        if not parallel:
            procs[-1][3].wait()
    for run_dir, log, start, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {log.name}")
        log.close()
        (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        print(f"{run_dir.name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return {arm: out / f"{arm}_seed{seed}" for arm in arms}


def summarise(run_dir: Path) -> dict[str, float]:
    metrics = json.loads((run_dir / "final_metrics.json").read_text())
    wall = run_dir / "wall_s.txt"
    metrics["wall_s"] = float(wall.read_text()) if wall.is_file() else float("nan")
    return metrics


def table(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    head = (
        "| arm | seed | eval format start | end | change | eval accuracy start | end | change "
        "| train reward first 3 | last 3 | wall min |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, seed, m in rows:
        fs, fe = m["summary/eval_format_rate_start"], m["summary/eval_format_rate_end"]
        acs, ace = m["summary/eval_gsm8k_accuracy_start"], m["summary/eval_gsm8k_accuracy_end"]
        rs, re_ = m["summary/train_reward_start"], m["summary/train_reward_end"]
        lines.append(
            f"| {arm} | {seed} | {fs:.3f} | {fe:.3f} | {fe - fs:+.3f} | {acs:.3f} | {ace:.3f} | {ace - acs:+.3f} "
            f"| {rs:.3f} | {re_:.3f} | {m['wall_s'] / 60:.1f} |"
        )
    return "\n".join(lines)


def gap_report(results: dict[str, dict[int, dict[str, float]]], seeds: list[int]) -> str:
    """Trained minus control on the final eval format rate and accuracy, per seed and mean."""
    if "trained" not in results or "control" not in results:
        return ""
    lines = ["| seed | format rate: trained - control | accuracy: trained - control |", "|---|---|---|"]
    gaps_f, gaps_a = [], []
    for s in seeds:
        t, c = results["trained"][s], results["control"][s]
        gf = t["summary/eval_format_rate_end"] - c["summary/eval_format_rate_end"]
        ga = t["summary/eval_gsm8k_accuracy_end"] - c["summary/eval_gsm8k_accuracy_end"]
        gaps_f.append(gf)
        gaps_a.append(ga)
        lines.append(f"| {s} | {gf:+.3f} | {ga:+.3f} |")
    mean_f, mean_a = sum(gaps_f) / len(gaps_f), sum(gaps_a) / len(gaps_a)
    lines.append(f"| mean | {mean_f:+.3f} | {mean_a:+.3f} |")
    every = all(g > 0 for g in gaps_f)
    lines.append(f"\nformat-rate gap: mean {mean_f:+.3f} (goal >= +0.30), every seed ahead: {'yes' if every else 'no'}")
    return "\n".join(lines)


def time_to_target_report(runs: dict[str, dict[int, RunData]], target: float) -> str:
    lines = [f"time until rollout/format_rate (mean of 3 rounds) >= {target}:", ""]
    lines += ["| arm | seed | seconds |", "|---|---|---|"]
    for arm, by_seed in runs.items():
        for seed, run in sorted(by_seed.items()):
            t = time_to_target(run, "rollout/format_rate", target)
            lines.append(f"| {arm} | {seed} | {'not reached' if t is None else f'{t:.0f}'} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, RunData]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ROUND_TAGS), figsize=(11, 3.8), squeeze=False)
    colors = {"trained": "tab:blue", "control": "tab:gray", "no_ds": "tab:orange"}
    for ax, tag in zip(axes[0], ROUND_TAGS, strict=True):
        for arm, by_seed in runs.items():
            for i, (_, run) in enumerate(sorted(by_seed.items())):
                values = series(run, tag)
                label = f"{arm} (lr=0)" if arm == "control" else arm
                ax.plot(range(len(values)), values, color=colors.get(arm), alpha=0.75, label=label if i == 0 else None)
        ax.set_title(f"{tag} per round (one line per seed)")
        ax.set_xlabel("round")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="learn_cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["trained", "control"], choices=sorted(ARMS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/learning"))
    parser.add_argument("--target", type=float, default=0.5, help="format rate for time-to-target")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: a seed's arms at once)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, Path]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        dirs = run_arms(args.out, args.experiment, args.arms, seed, args.overrides, args.force, not args.sequential)
        for arm, run_dir in dirs.items():
            runs[arm][seed] = run_dir
    results = {arm: {s: summarise(d) for s, d in by_seed.items()} for arm, by_seed in runs.items()}
    scalars = {arm: {s: read_run(d) for s, d in by_seed.items()} for arm, by_seed in runs.items()}  # read once
    rows = [(arm, s, results[arm][s]) for s in args.seeds for arm in args.arms]
    report = "\n\n".join(
        part
        for part in (
            f"experiment={args.experiment}, seeds {args.seeds}",
            table(rows),
            gap_report(results, args.seeds),
            time_to_target_report(scalars, args.target),
        )
        if part
    )
    print(report)
    (args.out / "learning.md").write_text(report + "\n")
    plot(scalars, args.out / "learning.png")
    print(f"wrote {args.out / 'learning.md'} and {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
