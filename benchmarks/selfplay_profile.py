"""Where a self-play run's time goes: the games of its rounds, its evaluations, training, checkpoints, by part.

Runs `experiment=selfplay_tictactoe` (or `--experiment`) in this process, short by default (2 rounds, an evaluation
at the start and one at the end), with wall-clock timers around the functions that do each part of the work:

- the learner's moves: `generate` outside a swapped adapter (the learner, its mirror);
- the model opponents' moves: `generate` while a snapshot's or the base model's weights are swapped in;
- the adapter swaps themselves (`sampling_from`: copying the snapshot in and the policy back);
- the turn prompts (`TurnPrompts.encode`: chat template and tokenizer, history cut to the prompt limit);
- scoring the turns (`SelfPlay.rollouts_of`), the opponent pool (snapshots, draws, ratings);
- training (`GRPOModule.training_step` and its backward, the optimizer step), checkpoints;
- the rest of the games' own loop (scripted moves, rules, bookkeeping): the phase's time less its parts.

Each row is split by the phase it ran in: a round's games (`SelfPlay.sample_rollouts`) or an evaluation
(`GameEvaluator.evaluate`). Times are inclusive wall seconds, so a number is only comparable with another from
the same run on the same machine under the same load (say both beside a number you publish).

    python benchmarks/selfplay_profile.py                                  # 2 rounds of the recipe
    python benchmarks/selfplay_profile.py trainer.max_epochs=3 variant.games_per_group=8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from omegaconf import open_dict

from grpo_lightning.studies.jobs import compose

SHORT = ("trainer.max_epochs=2", "eval.at_start=true", "eval.every_n_rounds=2", "checkpoint.every_n_rounds=2")
"""The default run: two rounds, an evaluation before the first and after the last, one checkpoint."""


class Clock:
    """Inclusive wall seconds and call counts by (phase, part); `phase` is the outermost timed phase running."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.phase = "outside rounds and evaluations"
        self.swapped = 0
        self.first_phase_at: float | None = None
        """perf_counter() when the first phase began (the run's build and model load come before it)."""

    def wrap(self, owner, name: str, part: str | Callable[[], str], phase: bool = False) -> None:
        """Time `owner.name` as `part` (a callable: the part's name, asked at each call); `phase=True`: it is a
        phase, and the parts inside it are counted under it."""
        original = getattr(owner, name)
        clock = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            outer = clock.phase
            if phase:
                clock.phase = part
                if clock.first_phase_at is None:
                    clock.first_phase_at = time.perf_counter()
            key = (clock.phase, part if not callable(part) else part())
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds[key] += time.perf_counter() - start
                clock.calls[key] += 1
                clock.phase = outer

        setattr(owner, name, timed)

    def wrap_swaps(self, owner) -> None:
        """`sampling_from` is a context manager: its entering and leaving are the swap, the block is not."""
        original = owner.sampling_from
        clock = self

        @contextlib.contextmanager
        def timed(engine, weights):
            manager = original(engine, weights)
            start = time.perf_counter()
            manager.__enter__()
            clock.seconds[(clock.phase, "adapter swaps")] += time.perf_counter() - start
            clock.calls[(clock.phase, "adapter swaps")] += 1
            clock.swapped += 1
            try:
                yield
            finally:
                clock.swapped -= 1
                start = time.perf_counter()
                manager.__exit__(None, None, None)
                clock.seconds[(clock.phase, "adapter swaps")] += time.perf_counter() - start

        owner.sampling_from = timed


def instrument(clock: Clock) -> None:
    from lightning import LightningModule, Trainer

    from grpo_lightning.data.games import TurnPrompts
    from grpo_lightning.games.opponent_pool import OpponentPool
    from grpo_lightning.generation.hf import HFGenerator
    from grpo_lightning.generation.hf_engine import HFEngine
    from grpo_lightning.training.game_evaluation import GameEvaluator
    from grpo_lightning.training.module import GRPOModule
    from grpo_lightning.variants.selfplay import SelfPlay

    clock.wrap(SelfPlay, "sample_rollouts", "round: games", phase=True)
    clock.wrap(GameEvaluator, "evaluate", "evaluation", phase=True)
    clock.wrap(HFEngine, "sample", lambda: "opponent moves (generate)" if clock.swapped else "learner moves (generate)")
    clock.wrap_swaps(HFGenerator)
    clock.wrap(TurnPrompts, "encode", "turn prompts (encode)")
    clock.wrap(SelfPlay, "rollouts_of", "scoring the turns")
    for method in ("add_snapshot", "sample", "record_all_ranks"):
        clock.wrap(OpponentPool, method, "opponent pool")
    clock.wrap(GRPOModule, "training_step", "training: forward + loss")
    clock.wrap(LightningModule, "backward", "training: backward")
    clock.wrap(LightningModule, "optimizer_step", "training: optimizer step (incl. forward + backward)")
    clock.wrap(Trainer, "save_checkpoint", "checkpoints")


def render(clock: Clock, wall: float, first_phase: float | None) -> str:
    phases: dict[str, float] = defaultdict(float)
    for (phase, part), seconds in clock.seconds.items():
        if phase == part:
            phases[phase] += seconds
    lines = ["| phase | part | calls | seconds | share of the run |", "|---|---|---|---|---|"]
    for phase in sorted({p for p, _ in clock.seconds}, key=lambda p: (p not in phases, p)):
        parts = sorted(((part, s) for (p, part), s in clock.seconds.items() if p == phase and part != phase),
                       key=lambda item: -item[1])  # fmt: skip
        total = phases.get(phase)
        if total is not None:
            lines.append(f"| {phase} | (all) | {clock.calls[(phase, phase)]} | {total:.1f} | {total / wall:.1%} |")
        for part, seconds in parts:
            lines.append(f"| {phase} | {part} | {clock.calls[(phase, part)]} | {seconds:.1f} | {seconds / wall:.1%} |")
        if total is not None:  # the parts of a phase do not nest in one another
            rest = total - sum(s for _, s in parts)
            what = "the rest (rules, scripted moves, bookkeeping)"
            lines.append(f"| {phase} | {what} | | {rest:.1f} | {rest / wall:.1%} |")
    lines.append(f"| run | wall: config check, model load, rounds, evaluations | | {wall:.1f} | 100% |")
    if first_phase is not None:
        lines.append(f"| run | before the first evaluation or round (build, load) | | {first_phase:.1f} | "
                     f"{first_phase / wall:.1%} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="selfplay_tictactoe")
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after the short run's (they win)")
    args = parser.parse_args(argv)
    overrides = [f"experiment={args.experiment}", *SHORT, "trainer.enable_progress_bar=false", *args.overrides]
    cfg = compose(overrides)
    clock = Clock()
    instrument(clock)
    from grpo_lightning.app.train import train

    with tempfile.TemporaryDirectory() as tmp:
        with open_dict(cfg):
            cfg.paths.output_dir = str(args.out or Path(tmp) / "run")
        start = time.perf_counter()
        metrics = train(cfg)
        wall = time.perf_counter() - start
    first_phase = None if clock.first_phase_at is None else clock.first_phase_at - start
    text = f"{' '.join(overrides)}\n\n{render(clock, wall, first_phase)}"
    games, turns = metrics.get("game/games"), metrics.get("game/learner_turns_mean")
    if games is not None and turns is not None:
        text += f"\n\nlast round: {games:.0f} games, {turns:.2f} learner turns a game"
    print(text)
    if args.json is not None:
        rows = [{"phase": p, "part": part, "calls": clock.calls[(p, part)], "seconds": s}
                for (p, part), s in clock.seconds.items()]  # fmt: skip
        args.json.write_text(json.dumps({"overrides": overrides, "wall_s": wall, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
