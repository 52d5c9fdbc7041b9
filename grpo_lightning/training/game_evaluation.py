"""Evaluation of self-play by playing (data=games, variant=selfplay; docs/selfplay.md): win / draw / loss rates
against fixed opponents, each with its 95% Wilson interval, and the illegal-move rate.

Every evaluation plays the same games: `eval.num_problems` test seeds (disjoint from training's), each from both
seats, against each of `eval.opponents` (default the random-move player and the base model, adapter off). The
policy samples at the training temperature (greedy play of a deterministic game would give one game per seat),
under a forked RNG seeded from `eval.seed`, so evaluations differ only by the policy, and training's random state
never moves. Metrics: `eval/win_rate_vs_<opponent>` with `_ci95_low` / `_ci95_high`, `eval/draw_rate_vs_<o>`,
`eval/loss_rate_vs_<o>`, `eval/illegal_move_rate` over all the learner's moves (`eval/learner_moves`) with its
interval, and `eval/games`; in a game with a payoff of its own (Kuhn Poker's chips), `eval/payoff_vs_<o>`, the mean
payoff with its interval. Each per-opponent metric also comes per seat (`..._first`, `..._second`).

A game with an exact best response (`TwoPlayerGame.responds_exactly`: Kuhn Poker) is also judged by
`eval/exploitability`: what a best response wins against the policy's strategy, in chips a hand on the seats' mean
(0 at an equilibrium; games/kuhn_poker.py `exploitability`). The strategy is read from the policy's probabilities
of each legal move's text at the game's information sets (games/policy_moves.py `policy_strategy`), not from
the games played: Kuhn Poker's 12, one forward of 24 rows, on every rank (the same weights give the same value; a
sharded policy's forward needs every rank), which leaves training as it was.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch

from grpo_lightning.data.games import TurnPrompts
from grpo_lightning.distributed import derive_seed, gather_objects, rank_and_world
from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.exact import Expected
from grpo_lightning.games.opponent_pool import opponent_names
from grpo_lightning.games.play import MOVE_POLICIES, SCRIPTED, Match, ModelPlayer, MoveSampler, play
from grpo_lightning.games.policy_moves import (
    LegalMoveSampler,
    ScoresCompletions,
    exact_results,
    move_terminator,
    policy_strategy,
)
from grpo_lightning.games.registry import make_game
from grpo_lightning.generation.adapters import swapping_adapters
from grpo_lightning.models.lora import adapter_off
from grpo_lightning.schema import check_settings, choice, integer, setting
from grpo_lightning.training.evaluation import EvalSettings, Evaluator, wilson_interval

log = logging.getLogger(__name__)


def scripted_names(value) -> str | None:
    """A rule: a list of scripted players (`games.play.SCRIPTED`), whose move distributions are exact; empty: none."""
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 0:
        return None
    problem = opponent_names(value)
    if problem is not None:
        return problem
    other = [v for v in value if v not in SCRIPTED]
    return f"must name only {', '.join(SCRIPTED)} ({other[0]!r} is none of them)" if other else None


@dataclass(frozen=True)
class GameEvalSettings:
    """`eval` keys of the game evaluator, beside the shared ones (`num_problems`: test seeds, each played from both
    seats against every opponent)."""

    opponents: list[str] = setting(
        rule=opponent_names,
        factory=lambda: ["random", "base"],
    )
    max_turns: int = setting(30, integer(1))
    exact_opponents: list[str] = setting(rule=scripted_names, factory=list)
    move_policy: str = setting("text", choice(*MOVE_POLICIES))

    def __post_init__(self) -> None:
        check_settings(self, "eval")


SEAT_NAMES = ("first", "second")
"""How the per-seat metrics name the learner's seat: `eval/win_rate_vs_random_first` moved first (seat 0)."""


def rate_metrics(name: str, scores: list[float]) -> dict[str, float]:
    """Win / draw / loss rates of the learner's `scores` (+1 / 0 / -1) against `name`, each with its 95% Wilson
    interval (`..._ci95_low`, `..._ci95_high`)."""
    n = max(len(scores), 1)
    metrics: dict[str, float] = {}
    for what, count in (
        ("win", sum(s > 0 for s in scores)),
        ("draw", sum(s == 0 for s in scores)),
        ("loss", sum(s < 0 for s in scores)),
    ):
        low, high = wilson_interval(count, len(scores))
        key = f"eval/{what}_rate_vs_{name}"
        metrics |= {key: count / n, f"{key}_ci95_low": low, f"{key}_ci95_high": high}
    return metrics


@dataclass(frozen=True)
class Played:
    """One evaluation game as the ranks gather it: the opponent's name, the learner's seat, its result (+1 / 0 /
    -1), its payoff (`Match.learner_payoff`) and whether each of its moves was illegal."""

    opponent: str
    seat: int
    score: float
    payoff: float
    illegal: list[bool]


def payoff_metrics(name: str, payoffs: list[float]) -> dict[str, float]:
    """The learner's mean payoff against `name` (games with a payoff of their own, `TwoPlayerGame.payoff_unit`:
    Kuhn Poker's chips), with a 95% interval: mean +- 1.96 standard errors (the sample's, n - 1), normal-theory;
    a payoff takes few values, and with the evaluation's 64+ games a side the mean is close to normal."""
    n = len(payoffs)
    mean = sum(payoffs) / n if n else 0.0
    spread = 1.96 * math.sqrt(sum((p - mean) ** 2 for p in payoffs) / (n - 1) / n) if n > 1 else 0.0
    key = f"eval/payoff_vs_{name}"
    return {key: mean, f"{key}_ci95_low": mean - spread, f"{key}_ci95_high": mean + spread}


def played_metrics(games: list[Played], opponents: list[str], has_payoff: bool) -> dict[str, float]:
    """The metrics of every rank's evaluation games: per opponent, both seats then each (the first mover's edge
    shows apart), the rates and the payoff; the illegal-move rate over all the learner's moves; the counts."""
    metrics: dict[str, float] = {}
    for name in opponents:
        for suffix, seats in (("", (0, 1)), *((f"_{n}", (seat,)) for seat, n in enumerate(SEAT_NAMES))):
            these = [g for g in games if g.opponent == name and g.seat in seats]
            metrics |= rate_metrics(name + suffix, [g.score for g in these])
            if has_payoff:
                metrics |= payoff_metrics(name + suffix, [g.payoff for g in these])
    illegal = [flag for g in games for flag in g.illegal]
    low, high = wilson_interval(sum(illegal), len(illegal))
    metrics["eval/illegal_move_rate"] = sum(illegal) / max(len(illegal), 1)
    metrics["eval/illegal_move_rate_ci95_low"], metrics["eval/illegal_move_rate_ci95_high"] = low, high
    metrics["eval/learner_moves"] = float(len(illegal))
    metrics["eval/games"] = float(len(games))
    return metrics


class GameEvaluator(Evaluator):
    """The evaluator of data=games: `at_fit_start`, `after_round` and the history as `Evaluator`'s; `evaluate`
    plays. `reward` and `checker` are the shared `eval` node's and unused here (set `eval.reward: null`)."""

    settings_types = (EvalSettings, GameEvalSettings)
    plays_games = True

    def __init__(self, dataset, reward=None, checker=None, **keys) -> None:
        super().__init__(dataset, reward=None, checker=_NoChecker(), **keys)
        (self.game_settings,) = self.own_settings
        """`eval.opponents` and `eval.max_turns` (`GameEvalSettings`)."""
        self.seeds: list[int] = []
        self._prompts: TurnPrompts | None = None
        self._warned_no_module = False

    def at_fit_start(self, trainer: L.Trainer) -> None:
        if not self.settings.enabled:
            return
        self.seeds = [p.record.seed for p in self.dataset.load()][: self.settings.num_problems]
        if self.settings.at_start and trainer.ckpt_path is None:
            self.evaluate(trainer)

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer) -> dict[str, float]:
        start = time.perf_counter()
        rank, world_size = rank_and_world()
        own = swapping_adapters(self.generator, "eval (data=games)").adapter_weights()
        matches = []
        for name in self.game_settings.opponents:
            opponent = SCRIPTED[name]() if name in SCRIPTED else ModelPlayer("base", adapter_off(own))
            for seed in self.seeds[rank::world_size]:
                for seat in (0, 1):
                    game = make_game(self.dataset.game)
                    game.reset(seed)
                    rng = random.Random(derive_seed(self.settings.seed, "eval", name, seed, seat))
                    matches.append(Match(game, seat, opponent, rng))

        if self._prompts is None:  # one for the run: its first cut is warned once
            limit = self.settings.max_prompt_tokens
            self._prompts = TurnPrompts(self.dataset, self.tokenizer, limit, "eval.max_prompt_tokens", metric=None)

        def encode(game: TwoPlayerGame, player: int) -> list[int]:  # within eval.max_prompt_tokens, as training's
            return self._prompts.encode(game, player)[0]

        with (
            torch.random.fork_rng(),
            self.generator.sampling_session(),
            self.generator.rows_per_call(self.settings.batch_size),
        ):  # never moves training's RNG
            torch.manual_seed(self.settings.seed)
            play(matches, self.generator, encode, self._decode, self.dataset.reply_prefix, self.game_settings.max_turns,
                 self.settings.max_new_tokens, move_sampler=self._move_sampler(trainer))  # fmt: skip
        parts = gather_objects([Played(m.opponent.name, m.learner_seat, m.learner_score, m.learner_payoff,
                                       [t.illegal for t in m.turns]) for m in matches])  # fmt: skip
        has_payoff = make_game(self.dataset.game).payoff_unit is not None
        metrics = played_metrics([g for part in parts for g in part], self.game_settings.opponents, has_payoff)
        if make_game(self.dataset.game).responds_exactly:
            metrics |= self._exploitability(trainer, encode)
        if self.game_settings.exact_opponents:
            metrics |= self._exact(trainer, encode)
        metrics["time/eval_s"] = time.perf_counter() - start
        self.record(trainer, metrics)
        log.info("eval at step %d: %s", trainer.global_step,
                 ", ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items() if k == "eval/exploitability"
                           or k.startswith("eval/win_rate_vs_") and not k.endswith(("low", "high"))))  # fmt: skip
        return metrics

    def _scoring_module(self, trainer: L.Trainer, what: str) -> ScoresCompletions | None:
        """The training module, whose log-probs read the policy's moves; None (warned once) for a stand-in trainer
        with none."""
        module = trainer.lightning_module
        if isinstance(module, ScoresCompletions):
            return module
        if not self._warned_no_module:
            self._warned_no_module = True
            log.warning("%s needs the training module's log-probs; this trainer has none", what)
        return None

    @property
    def terminator(self) -> int | None:
        """What ends a move read over the legal moves (`move_terminator` of `eval.move_policy`)."""
        return move_terminator(self.tokenizer, self.game_settings.move_policy)

    def _move_sampler(self, trainer: L.Trainer) -> MoveSampler | None:
        """`eval.move_policy=legal_moves`: the policy's moves drawn over the legal moves, as training draws them."""
        if self.game_settings.move_policy != "legal_moves":
            return None
        module = self._scoring_module(trainer, "eval.move_policy=legal_moves")
        if module is None:
            raise RuntimeError(
                "eval.move_policy=legal_moves reads the policy's probabilities: the trainer has no module"
            )
        return LegalMoveSampler(module, self.tokenizer, self.dataset.reply_prefix)

    def _exploitability(self, trainer: L.Trainer, encode) -> dict[str, float]:
        """`eval/exploitability` of the policy's strategy, read from its probabilities (every rank), in a game with
        an exact best response (Kuhn Poker)."""
        module = self._scoring_module(trainer, "eval/exploitability")
        if module is None:
            return {}
        game = make_game(self.dataset.game)
        strategy = policy_strategy(module, encode, game, self.tokenizer, self.dataset.reply_prefix, self.terminator)
        return {"eval/exploitability": game.exploitability(strategy)}

    def _exact(self, trainer: L.Trainer, encode) -> dict[str, float]:
        """`eval/exact_{win,draw,loss}_rate_vs_<o>` (both seats' mean, and `_first` / `_second`): the policy's exact
        results against each of `eval.exact_opponents`, from its move distribution at every position it can reach
        (games/policy_moves.py; every rank, as the exploitability)."""
        module = self._scoring_module(trainer, "eval.exact_opponents")
        if module is None:
            return {}
        opponents = {name: SCRIPTED[name]() for name in self.game_settings.exact_opponents}
        found = exact_results(module, encode, lambda: make_game(self.dataset.game), opponents, self.tokenizer,
                              self.dataset.reply_prefix, rows_per_forward=self.settings.batch_size,
                              max_moves=self.game_settings.max_turns, terminator=self.terminator)  # fmt: skip
        metrics = {}
        for name, (first, second) in found.items():
            for suffix, value in (("", Expected.mean([first, second])), ("_first", first), ("_second", second)):
                for what in ("win", "draw", "loss"):
                    metrics[f"eval/exact_{what}_rate_vs_{name}{suffix}"] = getattr(value, what)
        return metrics


class _NoChecker:
    """Games are judged by their outcome, not by an answer checker."""

    def check(self, completion, reference, record=None):
        raise RuntimeError("games are judged by playing them")
