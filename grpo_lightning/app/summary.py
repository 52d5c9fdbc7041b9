"""The closing summary of a run: did the policy get better? Printed at the end of every run.

Round-to-round training rewards are noisy (a few prompts per round), so the summary compares the mean of the
first `window` rounds with the mean of the last `window` rounds, and the first evaluation with the last.
The same numbers go into `final_metrics.json` under `summary/`, where sweeps and benchmarks read them.

Pure: imports neither Lightning nor Hydra.
"""

from __future__ import annotations

from collections.abc import Sequence


def start_end(values: Sequence[float], window: int = 3) -> tuple[float, float]:
    """Mean of the first `window` values and mean of the last `window` values (they overlap on short runs)."""
    if not values:
        raise ValueError("no values to summarise")
    head, tail = values[:window], values[-window:]
    return sum(head) / len(head), sum(tail) / len(tail)


def summary_metrics(
    rounds: Sequence[tuple[int, float, float]], evals: Sequence[tuple[int, dict[str, float]]], window: int = 3
) -> dict[str, float]:
    """`summary/*` metrics from (round, reward mean, format rate) per round and (step, metrics) per evaluation."""
    out: dict[str, float] = {}
    if rounds:
        for name, column in (("reward", 1), ("format_rate", 2)):
            start, end = start_end([r[column] for r in rounds], window)
            out[f"summary/train_{name}_start"], out[f"summary/train_{name}_end"] = start, end
    if evals:
        first, last = evals[0][1], evals[-1][1]
        for name in EVAL_NAMES:
            key = f"eval/{name}"
            if key in first and key in last:
                out[f"summary/eval_{name}_start"], out[f"summary/eval_{name}_end"] = first[key], last[key]
            for bound in ("low", "high"):  # the last evaluation's 95% interval (training/evaluation.py)
                if f"{key}_ci95_{bound}" in last:
                    out[f"summary/eval_{name}_end_ci95_{bound}"] = last[f"{key}_ci95_{bound}"]
    return out


EVAL_NAMES = (
    "format_rate",
    "gsm8k_accuracy",
    "accuracy",
    "accuracy_strict",
    "win_rate_vs_random",
    "win_rate_vs_base",
    "loss_rate_vs_tactic",
    "illegal_move_rate",
    "exploitability",
)
"""The evaluation metrics the summary compares (eval/<name>; docs/data.md, "Evaluation"): `accuracy` reads the
answer without regard to its format, `accuracy_strict` only in the asked format, `gsm8k_accuracy` is GSM8K's
own; self-play's win rates, the loss rate against `tactic`, the illegal-move rate and Kuhn Poker's exploitability
(docs/selfplay.md)."""


def render(metrics: dict[str, float], num_rounds: int, num_evals: int, window: int = 3) -> str:
    """The summary as a few aligned lines: start -> end (change) of each `summary/*` pair."""
    lines = []
    labels = [
        ("train_reward", f"train/reward_mean (first {window} -> last {window} of {num_rounds} rounds)"),
        ("train_format_rate", f"rollout/format_rate (first {window} -> last {window} rounds)"),
        *((f"eval_{name}", f"eval/{name} (first -> last of {num_evals} evaluations)") for name in EVAL_NAMES),
    ]
    for key, label in labels:
        start, end = metrics.get(f"summary/{key}_start"), metrics.get(f"summary/{key}_end")
        if start is not None and end is not None:
            line = f"  {label:<58} {start:.3f} -> {end:.3f} ({end - start:+.3f})"
            low, high = metrics.get(f"summary/{key}_end_ci95_low"), metrics.get(f"summary/{key}_end_ci95_high")
            if low is not None and high is not None:
                line += f", 95% CI [{low:.3f}, {high:.3f}]"
            lines.append(line)
    return "run summary:\n" + "\n".join(lines) if lines else ""
