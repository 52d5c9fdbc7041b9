"""Does self-play make the model a better player? experiment=selfplay_tictactoe against its control, over seeds and
credit choices.

Runs `python -m grpo_lightning experiment=<recipe> seed=<s>` per arm and seed, reads every run's evaluations back
(TensorBoard) and writes `selfplay.md` (printed too) and `selfplay.png` into the output folder:

- per run, at the start and the end: the win rate against the random-move player (both seats, then each seat), the
  loss rate against `tactic`, the win rate against the base model, each with its 95% Wilson interval, and the
  illegal-move rate with its interval;
- per arm and seed, the run's end against its control: whether the win rate against random rose and the loss rate
  against `tactic` and the illegal-move rate fell beyond the intervals (the test is stated in the table);
- per arm and seed, for TicTacToe, the play targets: win rate against random >= 0.80 with its interval's low end
  above 0.611 (the lowest-free-cell rule's), loss rate against `tactic` below 0.886 (the same rule's;
  docs/selfplay.md);
- the curve: per arm, the win rate against random and the loss rate against `tactic` at every evaluation, against
  the games the learner has trained on, each seed and their mean, beside what training had to learn from since the
  evaluation before (the share of groups whose rewards were all equal, the gradient norm; each seed's mean);
- the plot: both rates against the games trained on, each run and its control, and for TicTacToe the win target
  and the lowest-free-cell rule's exact win rate.

Arms (`--arms`, default `trained`), each the recipe with its credit choice (docs/selfplay.md):

- `trained`: the recipe as it is (reward=selfplay, the group's games the baseline);
- `role`: reward=selfplay_role (the role baseline, then a batch z-score);
- `rae`: reward=selfplay_rae (SPIRAL's role-conditioned advantage alone);
- `last_move`: reward=selfplay with per-move credit (`reward.terms.outcome.discount=0.5`);
- TicTacToe's spread levers, each alone (docs/selfplay.md "Keeping the spread"): `shuffled` (the legal moves
  listed in a seeded random order, `data.dataset.game=tictactoe_shuffled`), `entropy` (`loss.entropy_coef=0.01`),
  `kl` (`loss.beta=0.04`), `noisy_opponents` (`tactic` and `perfect` in the training pool, each playing a random
  move with probability 0.3); `levers`: all four; `loss_levers`: the entropy bonus and the KL term (any game);
- `best_response` (Kuhn Poker): the training pool is the exact best response to the policy of the round and the
  policy's newest snapshot (`variant.fixed_opponents=[best_response]`, `variant.max_snapshots=1`);
- `moves`: moves drawn and trained over the legal moves (`variant.move_policy=legal_moves`); `magnet`: with the
  uniform magnet at weight 0.2 (`variant.magnet=uniform`, `loss.magnet_coef=0.2`); `magnet_best_response`: that
  against the best-response pool; `position`: credit per position (`variant.position_weight=1.0`);
  `magnet_position`: the magnet with credit per position.

Beside the rates: per run, the spread GRPO learns from (`game/move_entropy`, `game/groups_alike_frac`), each
averaged over the first and the second half of the rounds; for Kuhn Poker, the exact exploitability
(`eval/exploitability`) at the start and the end, against the control's and the simple rules' 1/3.

The control (`--control lr0`, the default) is the same recipe with `optim.optimizer.lr=0`, one a seed for every arm
(lr=0 trains nothing, whatever the reward). `--control start` runs none: an lr=0 run never changes its weights,
and the game evaluation samples under a fixed seed (`eval.seed`), so its every evaluation plays exactly the games of
the trained run's start-of-run evaluation (tests/unit/test_selfplay.py checks that two evaluations of unchanged
weights are identical, and the table says whether a finished lr=0 run's evaluations all equal its trained run's
start). A seed whose lr=0 run has finished in the output folder is compared with it either way. The lr=0 run is
the recipe's: an arm that evaluates other prompts (`shuffled`, `levers`) starts elsewhere and is compared with its
own start, which is what its own lr=0 run would play at every evaluation.

    python benchmarks/selfplay.py                         # seeds 0 1 2, trained + lr=0 controls
    python benchmarks/selfplay.py --seeds 1 2 --control start   # half the compute: control = each run's start
    python benchmarks/selfplay.py --arms trained rae last_move --seeds 0 --control start   # the credit choices
    python benchmarks/selfplay.py --arms shuffled entropy kl noisy_opponents --seeds 0 --control start \
        trainer.max_epochs=5                              # the spread levers alone, 160 games each
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from grpo_lightning.studies.analysis import RunData, read_run
from grpo_lightning.studies.jobs import Job, compose, finished, run_jobs, wall_seconds

WIN = "eval/win_rate_vs_random"
WIN_FIRST = "eval/win_rate_vs_random_first"
WIN_SECOND = "eval/win_rate_vs_random_second"
LOSS_TACTIC = "eval/loss_rate_vs_tactic"
WIN_BASE = "eval/win_rate_vs_base"
ILLEGAL = "eval/illegal_move_rate"
PAYOFF_RANDOM = "eval/payoff_vs_random"
PAYOFF_PERFECT = "eval/payoff_vs_perfect"
TAGS = (WIN, WIN_FIRST, WIN_SECOND, LOSS_TACTIC, WIN_BASE, ILLEGAL, PAYOFF_RANDOM, PAYOFF_PERFECT)
EXPLOITABILITY = "eval/exploitability"
SIMPLE_RULES_EXPLOITABILITY = 1 / 3
"""Kuhn Poker: the least exploitable of the simple rules, always check and call a bet, or always bet and call (1/3
chips a hand each; uniform random 11/24, check and fold 1; tests/unit/test_kuhn_exploitability.py, exact)."""
SPREAD = ("game/move_entropy", "game/groups_alike_frac")
"""The spread GRPO learns from, every round: the entropy of the moves chosen per position, the share of groups
whose games all ended alike (docs/selfplay.md)."""
SIGNAL = ("train/frac_zero_std_groups", "train/grad_norm")
"""What GRPO has to learn from, a round: the share of groups whose rewards were all equal, and the gradient norm
(`game/groups_alike_frac` counts groups of equal outcomes instead)."""
NOISY_OPPONENTS = ("variant.fixed_opponents=[random,tactic,perfect]", "variant.scripted_epsilon=0.3")
SPREAD_LEVERS = {
    "shuffled": ("data.dataset.game=tictactoe_shuffled",),
    "entropy": ("loss.entropy_coef=0.01",),
    "kl": ("loss.beta=0.04",),
    "noisy_opponents": NOISY_OPPONENTS,
}
"""TicTacToe's spread levers, each alone (docs/selfplay.md "Keeping the spread"): the legal-move list in a seeded
random order, the entropy bonus, the KL term to the base, and `tactic` and `perfect` in the training pool playing a
random move with probability 0.3."""
ARMS = {
    "trained": (),
    "role": ("reward=selfplay_role",),
    "rae": ("reward=selfplay_rae",),
    "last_move": ("reward.terms.outcome.discount=0.5",),
    **SPREAD_LEVERS,
    "levers": tuple(o for overrides in SPREAD_LEVERS.values() for o in overrides),
    "loss_levers": (*SPREAD_LEVERS["entropy"], *SPREAD_LEVERS["kl"]),
    "best_response": ("variant.fixed_opponents=[best_response]", "variant.max_snapshots=1"),
    "moves": ("variant.move_policy=legal_moves",),
    "magnet": ("variant.move_policy=legal_moves", "variant.magnet=uniform", "loss.magnet_coef=0.2"),
    "position": ("variant.position_weight=1.0",),
    "magnet_position": (
        "variant.move_policy=legal_moves",
        "variant.magnet=uniform",
        "loss.magnet_coef=0.2",
        "variant.position_weight=1.0",
    ),
    "magnet_best_response": (
        "variant.move_policy=legal_moves",
        "variant.magnet=uniform",
        "loss.magnet_coef=0.2",
        "variant.fixed_opponents=[best_response]",
        "variant.max_snapshots=1",
    ),
}
"""Each arm's overrides on top of the recipe: the credit it trains with, or a spread lever (`levers`: all four;
`loss_levers`: the entropy bonus and the KL term, the two that apply to any game; `best_response`: Kuhn Poker
against the exact best response to the round's policy and its newest snapshot, half the groups each)."""
LOWEST_FREE_CELL = {"win_vs_random": 0.611, "loss_vs_tactic": 0.886}
"""The lowest-free-cell rule's exact rates, both seats averaged (tests/unit/test_exact_results.py)."""
TARGET_GAMES = ("tictactoe", "tictactoe_shuffled")
"""The games the play targets are set for (`data.dataset.game`): TicTacToe's rules, whose lowest-free-cell rates
the targets are; Kuhn Poker is judged by its exploitability instead."""
WIN_TARGET = 0.80
BEYOND_TEST = (
    "beyond = the trained run's 95% Wilson interval at the end lies wholly on the better side of its control's "
    "rate (win rate: above; loss rate and illegal-move rate: below). The control's evaluation plays the same seeded "
    "games with the unchanged start model"
)
TARGET_TEST = (
    f"targets: win vs random >= {WIN_TARGET:.2f} with the interval's low end above "
    f"{LOWEST_FREE_CELL['win_vs_random']} and loss vs tactic below {LOWEST_FREE_CELL['loss_vs_tactic']} (yes: the "
    "whole interval; rate only: the rate, with the interval reaching the bar), the lowest-free-cell rule's exact "
    "rates (docs/selfplay.md)"
)


@dataclass(frozen=True)
class Point:
    """One evaluation: a rate with its interval, by metric, after `step` rounds (one optimizer step each), that is
    after `games` training games."""

    step: int
    games: int
    rates: dict[str, tuple[float, float, float]]
    signal: dict[str, float]
    """The means of SIGNAL over the rounds since the previous evaluation (empty at the first)."""
    exploitability: float | None = None
    """Kuhn Poker: the policy's exact exploitability, chips a hand (no interval: computed, not sampled)."""


def games_per_round(run_dir: Path) -> int:
    """The games a training round plays: `data.prompts_per_round` seeds, `variant.games_per_group` games each (the
    run's composed config; a resume may not change either, docs/resuming.md)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    return int(cfg.data.prompts_per_round) * int(cfg.variant.games_per_group)


def evaluations(run: RunData) -> list[Point]:
    """Every evaluation of a run, in step order (rate, low, high of each of TAGS it logged)."""
    games = games_per_round(run.path)
    steps = sorted({s for s, _ in run.scalars.get(WIN, [])})
    points = []
    for previous, step in zip([None, *steps[:-1]], steps, strict=True):
        rounds = {tag: [v for s, v in run.scalars.get(tag, []) if previous is not None and previous <= s < step]
                  for tag in SIGNAL}  # fmt: skip
        signal = {tag: sum(values) / len(values) for tag, values in rounds.items() if values}
        rates = {}
        for tag in TAGS:
            values = {
                suffix: dict(run.scalars.get(tag + suffix, [])).get(step) for suffix in ("", "_ci95_low", "_ci95_high")
            }
            if values[""] is not None:
                rates[tag] = (values[""], values["_ci95_low"], values["_ci95_high"])
        exploitability = dict(run.scalars.get(EXPLOITABILITY, [])).get(step)
        points.append(Point(step, step * games, rates, signal, exploitability))
    return points


def spread_halves(run: RunData) -> dict[str, tuple[float | None, float | None]]:
    """Per SPREAD metric, its mean over the first half of the run's rounds and over the second (rounds 0-4 and 5-9
    of 10; the middle round of an odd count goes to the second half); None where the run logged none."""
    halves = {}
    for tag in SPREAD:
        values = sorted(run.scalars.get(tag, []))
        cut = len(values) // 2
        means = [sum(v for _, v in part) / len(part) if part else None for part in (values[:cut], values[cut:])]
        halves[tag] = (means[0], means[1])
    return halves


def finished_runs(out: Path, arms: list[str]) -> set[tuple[str, int]]:
    """(arm, seed) of every finished run of `arms` in `out` (read into the tables whatever `--seeds` says)."""
    return {
        (arm, int(d.name.removeprefix(f"{arm}_seed")))
        for arm in arms
        for d in out.glob(f"{arm}_seed*")
        if d.name.removeprefix(f"{arm}_seed").isdigit() and finished(d)
    }


def fmt(rate: tuple[float, float, float] | None) -> str:
    if rate is None:
        return "n/a"
    value, low, high = rate
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def beyond(trained: tuple[float, float, float], control: tuple[float, float, float], higher_is_better: bool) -> bool:
    _, low, high = trained
    return low > control[0] if higher_is_better else high < control[0]


def targets(end: dict[str, tuple[float, float, float]]) -> tuple[str, str]:
    """Whether a run's end meets the win target (rate and interval: yes / no) and the loss-vs-tactic target: `yes`
    when the whole interval lies below the rule's rate, `rate only` when the rate does and the interval reaches it
    (64 games cannot tell the two apart), `no`, or `n/a` when the run did not play `tactic`."""
    win, loss = end.get(WIN), end.get(LOSS_TACTIC)
    win_met = win is not None and win[0] >= WIN_TARGET and win[1] > LOWEST_FREE_CELL["win_vs_random"]
    if loss is None:
        return ("yes" if win_met else "no"), "n/a"
    bar = LOWEST_FREE_CELL["loss_vs_tactic"]
    loss_met = "yes" if loss[2] < bar else "rate only" if loss[0] < bar else "no"
    return ("yes" if win_met else "no"), loss_met


Runs = dict[tuple[str, int], tuple[list[Point], float]]
"""(arm, seed) -> (the run's evaluations, its wall seconds)."""
Controls = dict[tuple[str, int], tuple[list[Point], str]]
"""(arm, seed) -> (the evaluations the run is compared with, their kind: `lr=0` or `start`)."""


def pick_controls(runs: Runs, lr0: dict[int, list[Point]]) -> tuple[Controls, list[str]]:
    """Each run's control and the notes on the lr=0 runs (`lr0`: seed -> a finished lr=0 run's evaluations).

    The lr=0 run is the recipe's, so it controls the runs that start where it does (a credit arm, a loss lever);
    an arm that evaluates other prompts (the shuffled list) starts elsewhere and is compared with its own start,
    which is what its lr=0 run would play at every evaluation."""
    controls: Controls = {}
    notes = []
    for (arm, seed), (points, _) in sorted(runs.items()):
        control = lr0.get(seed)
        if control is not None and control[0].rates == points[0].rates:
            controls[arm, seed] = (control, "lr=0")
        else:
            controls[arm, seed] = (points[:1], "start")
    for seed, control in sorted(lr0.items()):
        compared = [arm for (arm, s), (_, kind) in sorted(controls.items()) if s == seed and kind == "lr=0"]
        same = bool(compared) and all(p.rates == control[0].rates for p in control)
        notes.append(
            f"seed {seed}: every evaluation of the lr=0 run {'equals' if same else 'DIFFERS from'} the trained "
            "runs' start-of-run evaluation"
        )
        others = [arm for (arm, s), (_, kind) in sorted(controls.items()) if s == seed and kind == "start"]
        if others:
            notes.append(
                f"seed {seed}: {', '.join(others)} started elsewhere than the lr=0 run (other prompts) and "
                "is compared with its own start"
            )
    return controls, notes


def control_rows(runs: Runs, controls: Controls, seed: int) -> list[tuple[str, list[Point]]]:
    """The distinct controls of a seed's runs, labelled: `lr=0`; `start` when every run compared with its start
    starts alike, else `start of <arms>` for each group of runs that start alike."""
    keys = sorted((key for key in runs if key[1] == seed), key=lambda key: list(ARMS).index(key[0]))
    rows = [("lr=0", controls[k][0]) for k in keys if controls[k][1] == "lr=0"][:1]
    groups: dict[str, tuple[list[str], list[Point]]] = {}
    for arm, _ in (k for k in keys if controls[k][1] == "start"):
        points = controls[arm, seed][0]
        groups.setdefault(repr(points[0].rates), ([], points))[0].append(arm)
    if len(groups) == 1:
        rows.append(("start", next(iter(groups.values()))[1]))
    else:
        rows += [(f"start of {', '.join(arms)}", points) for arms, points in groups.values()]
    return rows


def report(runs: Runs, controls: Controls, play_targets: bool) -> str:
    """Every run against its control (`pick_controls`), with the play targets' verdicts where `play_targets` (the
    runs play one of `TARGET_GAMES`)."""
    payoffs = [
        "| seed | arm | control | chips vs random, start -> end | beyond | chips vs perfect, start -> end | beyond |",
        "|---|---|---|---|---|---|---|",
    ]
    exploits = [
        "| seed | arm | control | exploitability, start -> end | end - control | below the simple rules' 1/3 |",
        "|---|---|---|---|---|---|",
    ]
    lines = [
        "| seed | arm | win vs random, start -> end | first seat, end | second seat, end | loss vs tactic, end | "
        "win vs base, end | illegal-move rate, start -> end | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gaps = [
        "| seed | arm | control | win vs random: end - control | beyond | loss vs tactic: end - control | beyond | "
        "illegal-move rate: end - control | beyond | win target | tactic target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(seed: int, arm: str, points: list[Point], seconds: float | None) -> str:
        start, end = points[0].rates, points[-1].rates
        return (
            f"| {seed} | {arm} | {fmt(start.get(WIN))} -> {fmt(end.get(WIN))} | {fmt(end.get(WIN_FIRST))} | "
            f"{fmt(end.get(WIN_SECOND))} | {fmt(end.get(LOSS_TACTIC))} | {fmt(end.get(WIN_BASE))} | "
            f"{fmt(start.get(ILLEGAL))} -> {fmt(end.get(ILLEGAL))} | "
            f"{'' if seconds is None or math.isnan(seconds) else f'{seconds / 60:.1f} min'} |"
        )

    for seed in sorted({seed for _, seed in runs}):
        for (arm, s), (points, wall) in sorted(
            runs.items(), key=lambda item: (item[0][1], list(ARMS).index(item[0][0]))
        ):
            if s != seed:
                continue
            control, kind = controls[arm, seed]
            lines.append(row(seed, arm, points, wall))
            t, c = points[-1].rates, control[-1].rates
            win_beyond = "yes" if beyond(t[WIN], c[WIN], True) else "no"
            illegal_beyond = "yes" if beyond(t[ILLEGAL], c[ILLEGAL], False) else "no"
            if LOSS_TACTIC in t and LOSS_TACTIC in c:
                tactic_gap = f"{t[LOSS_TACTIC][0] - c[LOSS_TACTIC][0]:+.3f}"
                tactic_beyond = "yes" if beyond(t[LOSS_TACTIC], c[LOSS_TACTIC], False) else "no"
            else:
                tactic_gap, tactic_beyond = "n/a", "n/a"
            gaps.append(
                f"| {seed} | {arm} | {kind} | {t[WIN][0] - c[WIN][0]:+.3f} | {win_beyond} | {tactic_gap} | "
                f"{tactic_beyond} | {t[ILLEGAL][0] - c[ILLEGAL][0]:+.3f} | {illegal_beyond} | "
                f"{' | '.join(targets(t) if play_targets else ('n/a', 'n/a'))} |"
            )
            if PAYOFF_RANDOM in t:  # a game with a payoff of its own (Kuhn Poker's chips)
                cells = [
                    f"{fmt(points[0].rates.get(tag))} -> {fmt(t.get(tag))} | "
                    + ("yes" if tag in t and tag in c and beyond(t[tag], c[tag], True) else "no")
                    for tag in (PAYOFF_RANDOM, PAYOFF_PERFECT)
                ]
                payoffs.append(f"| {seed} | {arm} | {kind} | {' | '.join(cells)} |")
            if points[-1].exploitability is not None:  # Kuhn Poker
                first, last, base = points[0].exploitability, points[-1].exploitability, control[-1].exploitability
                exploits.append(
                    f"| {seed} | {arm} | {kind} | {first:.3f} -> {last:.3f} | "
                    + (f"{last - base:+.3f}" if base is not None else "n/a")
                    + f" | {'yes' if last < SIMPLE_RULES_EXPLOITABILITY else 'no'} |"
                )
        for label, points in control_rows(runs, controls, seed):
            lines.append(row(seed, f"control ({label})", points, None))
    text = "\n".join(lines) + "\n\n" + "\n".join(gaps) + "\n\n" + BEYOND_TEST + "."
    if play_targets:
        text += "\n\n" + TARGET_TEST
    if len(payoffs) > 2:
        text += "\n\n" + "\n".join(payoffs) + "\n\nbeyond = the 95% interval of the mean chips a hand at the end "
        text += "lies wholly above the control's mean"
    if len(exploits) > 2:
        text += "\n\n" + "\n".join(exploits) + "\n\nexploitability = what a best response wins against the "
        text += "policy's strategy, chips a hand on the seats' mean (0 at an equilibrium; exact, from the model's "
        text += "probabilities of each legal action); the simple rules' (always check and call, always bet and call) "
        text += "is 1/3"
    return text


def spread_table(halves: dict[tuple[str, int], dict[str, tuple[float | None, float | None]]]) -> str:
    """Per run: the spread GRPO learns from (SPREAD), its means over the first and the second half of the rounds."""

    def cell(pair: tuple[float | None, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.3f}" for v in pair)

    lines = [
        "| seed | arm | move entropy (nats), first / second half of the rounds | groups alike, first / second half |",
        "|---|---|---|---|",
    ]
    for (arm, seed), by_tag in sorted(halves.items(), key=lambda item: (item[0][1], list(ARMS).index(item[0][0]))):
        lines.append(f"| {seed} | {arm} | {cell(by_tag[SPREAD[0]])} | {cell(by_tag[SPREAD[1]])} |")
    return "\n".join(lines)


def curve(runs: dict[tuple[str, int], tuple[list[Point], float]]) -> str:
    """Per arm, at every number of games trained on that some seed evaluated at: the win rate against random and
    the loss rate against `tactic`, each seed's (in seed order) and the mean over the seeds that evaluated there."""
    lines = [
        "| arm | games trained on | seeds | win vs random, each seed | mean | loss vs tactic, each seed | mean | "
        "groups with equal rewards since the last evaluation, each seed | gradient norm, each seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in [a for a in ARMS if any(a == r for r, _ in runs)]:
        by_games: dict[int, dict[int, Point]] = {}
        for seed in sorted(s for a, s in runs if a == arm):
            for point in runs[arm, seed][0]:
                by_games.setdefault(point.games, {})[seed] = point
        for games, points in sorted(by_games.items()):
            cells = []
            for tag in (WIN, LOSS_TACTIC):
                rates = [p.rates[tag][0] for _, p in sorted(points.items()) if tag in p.rates]
                cells += [
                    ", ".join(f"{r:.3f}" for r in rates) or "n/a",
                    f"{sum(rates) / len(rates):.3f}" if rates else "n/a",
                ]
            for tag in SIGNAL:
                means = [f"{p.signal[tag]:.3f}" for _, p in sorted(points.items()) if tag in p.signal]
                cells.append(", ".join(means) or "n/a")
            lines.append(f"| {arm} | {games} | {', '.join(map(str, sorted(points)))} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(runs: Runs, controls: Controls, path: Path, play_targets: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    last_games = max(points[-1].games for points, _ in runs.values())
    for ax, tag, title in ((axes[0], WIN, "win rate vs random"), (axes[1], ILLEGAL, "illegal-move rate")):
        for (arm, seed), (points, _) in sorted(runs.items()):
            ax.plot([p.games for p in points if tag in p.rates], [p.rates[tag][0] for p in points if tag in p.rates],
                    "-o", label=f"{arm} seed {seed}")  # fmt: skip
        for seed in sorted({seed for _, seed in runs}):
            for label, points in control_rows(runs, controls, seed):
                xs = [p.games for p in points if tag in p.rates]
                ys = [p.rates[tag][0] for p in points if tag in p.rates]
                if len(xs) == 1:  # the start evaluation, held level
                    xs, ys = [xs[0], last_games], ys * 2
                ax.plot(xs, ys, ":", label=f"control ({label}) seed {seed}")
        if tag == WIN and play_targets:
            ax.axhline(WIN_TARGET, color="grey", linestyle="--", linewidth=0.8, label="target")
            ax.axhline(LOWEST_FREE_CELL["win_vs_random"], color="grey", linestyle="-.", linewidth=0.8,
                       label="lowest free cell, exact")  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("training games played (one optimizer step a round)")
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="selfplay_tictactoe")
    parser.add_argument(
        "--arms", nargs="+", default=["trained"], choices=list(ARMS), help="the credit choices and spread levers"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--control", choices=("lr0", "start"), default="lr0")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/selfplay"))
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: one a core)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    try:  # a missing recipe or a bad override fails now, not an hour later
        games = {compose([f"experiment={args.experiment}", *ARMS[arm], *args.overrides]).data.dataset.game
                 for arm in args.arms}  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    play_targets = games <= set(TARGET_GAMES)
    args.out.mkdir(parents=True, exist_ok=True)
    arms = {arm: ARMS[arm] for arm in args.arms} | (
        {"control": ("optim.optimizer.lr=0",)} if args.control == "lr0" else {}
    )
    jobs = [
        Job(f"{arm}_seed{seed}", (f"experiment={args.experiment}", f"seed={seed}", *extra, *args.overrides))
        for seed in args.seeds
        for arm, extra in arms.items()
    ]
    run_jobs(args.out, jobs, parallel=not args.sequential, force=args.force)
    runs: Runs = {}
    read: dict[tuple[str, int], RunData] = {}
    for arm, seed in sorted(finished_runs(args.out, args.arms) | {(a, s) for a in args.arms for s in args.seeds}):
        run_dir = args.out / f"{arm}_seed{seed}"
        read[arm, seed] = read_run(run_dir)  # read once: the evaluations and the spread
        runs[arm, seed] = (evaluations(read[arm, seed]), wall_seconds(run_dir))
    seeds = sorted({seed for _, seed in runs})
    lr0 = {
        s: evaluations(read_run(args.out / f"control_seed{s}"))
        for s in seeds
        if finished(args.out / f"control_seed{s}")
    }
    controls, notes = pick_controls(runs, lr0)
    text = f"experiment={args.experiment}, arms {args.arms}, seeds {seeds}\n\n" + report(runs, controls, play_targets)
    halves = {key: spread_halves(run) for key, run in read.items()}
    if any(v is not None for by_tag in halves.values() for pair in by_tag.values() for v in pair):
        text += "\n\nThe spread (means over each half of the run's rounds):\n\n" + spread_table(halves)
    text += "\n\nThe curve (rates at each evaluation, by the games trained on before it):\n\n" + curve(runs)
    if notes:
        text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    print(text)
    (args.out / "selfplay.md").write_text(text + "\n")
    plot(runs, controls, args.out / "selfplay.png", play_targets)
    print(f"wrote {args.out / 'selfplay.md'} and {args.out / 'selfplay.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
