"""Self-play on two-player text games (docs/selfplay.md): turns of games as rollouts, opponents from a rated pool of
the policy's own snapshots, the base model and scripted players.

A round deals `data.prompts_per_round` game seeds (data=games). For each seed it draws one opponent from the pool
and a seat for the learner, and plays `games_per_group` games of that seed from that seat against that opponent:
the round's games all advance together, one batched generate per move (games/play.py). Every move the
learner made becomes a Rollout of exactly the prompt it was sampled from and its reply, scored by the reward
pipeline with the turn's record (`types.TurnRecord`: the game's outcome, whether the move was legal, the move).

Groups: the turns of a seed's games share an advantage group. Why those: the games of a group differ only by the
sampling, so the group's mean is a baseline of the same game, seat and opponent; a first mover's advantage or a
weak opponent lifts every turn of the group alike and cancels, instead of being credited to the moves. The
peer's role baseline is the alternative (reward=selfplay_role: a running mean per game and seat, then a batch
z-score).

Spread (docs/selfplay.md, "Keeping the spread"): GRPO learns from the spread of results inside a group, so every
round also logs the share of groups whose games all ended alike (`game/groups_alike_frac`) and the entropy of the
learner's moves per position (`game/move_entropy`). `scripted_epsilon` > 0 makes the training pool's `perfect` and
`tactic` play a uniformly random legal move with that probability (games/play.py `NoisyPlayer`); evaluation plays
them exactly.

Moves (docs/selfplay.md, "Moves over the legal moves"): by default model players write text and the game reads the
move in it; with `move_policy=legal_moves` they draw it from the policy's distribution over the legal moves
(games/policy_moves.py `LegalMoveSampler`), and the learner's rollouts carry that distribution's moves
(`types.MoveChoice`), which the training step trains over; `magnet` adds the pull toward a magnet strategy
(`loss.magnet_coef`). `position_weight` credits each move against the round's other moves from its position too.
The `best_response` opponent is the exact best response to the policy of the round (games that compute one).

Snapshots: at the start of every `snapshot_every`-th round (round 0 included) the policy's adapter joins the pool
(`round<NNN>`). The pool, its ratings and its snapshots are saved in every checkpoint; a resumed run plays on
exactly as the uninterrupted one.

Several processes (DDP): each rank plays the groups of its block of the round's seeds; after every batch of games
every rank applies every rank's results to its pool, in one order (rank, then the order dealt), so the ranks hold
one pool, draw opponents from the same ratings, and report the same `pool/...` values; `game/...` counts every
rank's games.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from grpo_lightning.algorithm.advantages import group_advantages
from grpo_lightning.data.games import GameSeeds, TurnPrompts
from grpo_lightning.distributed import derive_seed, gather_objects, rank_and_world, sum_counts_across_ranks
from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.opponent_pool import LEARNER, SAMPLING_MODES, OpponentPool, opponent_names
from grpo_lightning.games.play import (
    LEARNER_PLAYER,
    MOVE_POLICIES,
    NOISY,
    SCRIPTED,
    BestResponsePlayer,
    LearnerTurn,
    Match,
    ModelPlayer,
    NoisyPlayer,
    Player,
    groups_alike,
    move_entropy,
    play,
)
from grpo_lightning.games.policy_moves import LegalMoveSampler, ScoresCompletions, move_terminator, policy_strategy
from grpo_lightning.games.progress import SelfPlayProgress
from grpo_lightning.games.registry import builtin_games_where, make_game
from grpo_lightning.generation.adapters import SwapsAdapters, swapping_adapters
from grpo_lightning.models.lora import adapter_off
from grpo_lightning.rewards import games as game_rewards
from grpo_lightning.rewards.base import Stage
from grpo_lightning.schema import check_settings, choice, integer, number, setting, target_class
from grpo_lightning.types import Rollout, TurnRecord
from grpo_lightning.variants.base import GroupShape, GRPOVariant, register_variant

MAGNETS = ("none", "uniform", "snapshot")
"""The strategy `loss.magnet_coef` pulls the learner's moves toward (`variant.move_policy=legal_moves`): uniform over
the legal moves, or a snapshot of the policy taken every `variant.magnet_refresh` rounds (R-NaD's refresh)."""


def position_digest(prompt_ids: Sequence[int]) -> str:
    """A short stable name of the exact prompt a move was sampled from: the position as the policy saw it."""
    return hashlib.blake2b(repr(list(prompt_ids)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class SelfPlaySettings:
    """`variant` for variant=selfplay."""

    games_per_group: int = setting(4, integer(2))
    opponent_sampling: str = setting("random", choice(*SAMPLING_MODES))
    fixed_opponents: list[str] = setting(
        rule=opponent_names,
        factory=lambda: ["random", "base"],
    )
    snapshot_every: int = setting(2, integer(1))
    max_snapshots: int = setting(4, integer(1))
    lagged_window: int = setting(2, integer(1))
    max_turns: int = setting(30, integer(1))
    seed: int = setting(0, integer(0))
    scripted_epsilon: float = setting(0.0, number(0.0, 1.0))
    move_policy: str = setting("text", choice(*MOVE_POLICIES))
    magnet: str = setting("none", choice(*MAGNETS))
    magnet_refresh: int = setting(50, integer(1))
    position_weight: float = setting(0.0, number(low=0.0))

    def __post_init__(self) -> None:
        check_settings(self, "variant")


@register_variant("selfplay")
class SelfPlay(GRPOVariant):
    settings_types = (SelfPlaySettings,)
    plays_games = True

    def __init__(self, settings: SelfPlaySettings | None = None, /, **keys) -> None:
        super().__init__(settings, **keys)
        s = self.settings
        self.pool = OpponentPool(s.opponent_sampling, tuple(s.fixed_opponents), s.max_snapshots, s.lagged_window)
        self.source = None
        """The game data source (data/games.py GameSeeds): how an observation becomes a prompt (`bind_data`)."""
        self.tokenizer = None
        self.prompts: TurnPrompts | None = None
        """Turn prompts within `data.max_prompt_tokens` (`bind_data`): long histories cut, the cut warned once a run."""
        self.progress_listeners: list[Callable[[SelfPlayProgress], None]] = []
        """Called with the round's progress after every move of its games (training/live_view.py)."""
        self.module: ScoresCompletions | None = None
        """The training module (`bind_module`): the policy's move probabilities the `best_response` opponent answers."""
        self.round_index = 0
        self.move_sampler: LegalMoveSampler | None = None
        """Draws model players' moves over the legal moves (`variant.move_policy=legal_moves`; made at the first
        round, from the bound module)."""
        self.magnet_weights: dict[str, Tensor] | None = None
        """The snapshot magnet's adapter weights (`variant.magnet=snapshot`), taken every `magnet_refresh` rounds."""
        self._best_response: BestResponsePlayer | None = None
        """The round's best response to the policy (`variant.fixed_opponents` with `best_response`), made once a
        round before its first game."""
        self._snapshot_taken = False
        self._counts: dict[str, float] = {}
        self._moves: list[tuple[str, str | None]] = []
        """The round's learner moves so far, `(position, move)`: the prompt's digest and the move (`move_entropy`)."""

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """variant=selfplay plays data=games with the HF engine, a LoRA adapter (the snapshots are adapters), rounds
        that do not overlap, opponents the game can play and game reward terms (docs/selfplay.md)."""
        source = target_class(cfg.data.dataset.get("_target_"))
        if source is None or not issubclass(source, GameSeeds):
            raise ValueError(
                "variant=selfplay plays games: choose data=games (data.dataset.game=tictactoe or textarena:<id>)"
            )
        engine = target_class(cfg.generator.get("_target_"))
        if engine is not None and not issubclass(engine, SwapsAdapters):
            name = "generator=vllm" if engine.__name__ == "VLLMGenerator" else engine.__name__
            raise ValueError(
                "variant=selfplay plays its opponents by swapping adapter weights in the HF engine, which "
                f"{name} cannot do yet: use generator=hf"
            )
        if OmegaConf.select(cfg, "rollout.max_staleness", default=0) != 0:
            raise ValueError(
                "variant=selfplay samples from the current policy and its snapshots: set rollout.max_staleness=0"
            )
        if not cfg.model.lora.enabled:
            raise ValueError("variant=selfplay keeps its opponents as LoRA snapshots: set model.lora.enabled=true")
        game = make_game(cfg.data.dataset.game)
        game.reset(0)
        eval_opponents = list(cfg.eval.get("opponents") or []) if cfg.eval.enabled else []
        exact_opponents = list(cfg.eval.get("exact_opponents") or []) if cfg.eval.enabled else []
        if exact_opponents and not game.enumerable:
            enumerable = ", ".join(builtin_games_where(lambda g: g.enumerable))
            raise ValueError(
                f"eval.exact_opponents: exact results read the policy at every position it can reach, in games small "
                f"enough to enumerate ({enumerable}), and {game.game_id} is not one; set eval.exact_opponents=[]"
            )
        for key, names in (
            ("variant.fixed_opponents", cfg.variant.fixed_opponents),
            ("eval.opponents", eval_opponents),
            ("eval.exact_opponents", exact_opponents),
        ):
            if "perfect" in names and not game.solved:
                solved = ", ".join(builtin_games_where(lambda g: g.solved))
                raise ValueError(f"{key}: 'perfect' plays solved games only ({solved}), and {game.game_id} is not one")
            if "tactic" in names and not game.lists_winning_moves:
                raise ValueError(
                    f"{key}: 'tactic' plays games that list their winning moves "
                    f"({', '.join(builtin_games_where(lambda g: g.lists_winning_moves))}), and {game.game_id} does "
                    "not; leave it out"
                )
            if "best_response" in names and not game.responds_exactly:
                exact = ", ".join(builtin_games_where(lambda g: g.responds_exactly))
                raise ValueError(
                    f"{key}: 'best_response' answers the policy's exact strategy, in games that compute a best "
                    f"response ({exact}), and {game.game_id} is not one; leave it out"
                )
            if "best_response" in names and key != "variant.fixed_opponents":
                raise ValueError(
                    f"{key}: 'best_response' is a training opponent; what it wins against the policy is "
                    "eval/exploitability, computed exactly at every evaluation: leave it out"
                )
            if "random" in names and not game.legal_moves():
                raise ValueError(
                    f"{key}: 'random' plays a random legal move, and {cfg.data.dataset.game} does not list its legal "
                    "moves here (docs/selfplay.md); leave it out"
                )
        cls.check_moves(cfg, game)
        for place in ("terms", "transforms"):
            for name, spec in (cfg.reward.get(place) or {}).items():
                stage = target_class(spec.get("_target_")) if OmegaConf.is_dict(spec) else None
                reads_records = isinstance(stage, type) and issubclass(stage, Stage) and stage.needs_record
                if reads_records and stage.__module__ != game_rewards.__name__:
                    raise ValueError(
                        f"reward.{place}.{name} ({stage.__name__}) scores another data source's records, not game "
                        "turns: use reward=selfplay"
                    )

    @staticmethod
    def check_moves(cfg: DictConfig, game: TwoPlayerGame) -> None:
        """`variant.move_policy`, `variant.magnet` and `loss.magnet_coef` together: moves over the legal moves need
        a game that lists them; a magnet pulls moves drawn over them, with a weight; the evaluation plays the policy
        as training does."""
        policy, magnet = cfg.variant.get("move_policy", "text"), cfg.variant.get("magnet", "none")
        coef = float(cfg.loss.get("magnet_coef", 0.0))
        if policy == "legal_moves" and not game.legal_moves():
            raise ValueError(
                f"variant.move_policy=legal_moves draws moves over the legal moves, and {game.game_id} does not list "
                "them here: use variant.move_policy=text"
            )
        if magnet != "none" and policy != "legal_moves":
            raise ValueError(
                f"variant.magnet={magnet} pulls the distribution over the legal moves: set "
                "variant.move_policy=legal_moves (or variant.magnet=none)"
            )
        if magnet != "none" and coef == 0:
            raise ValueError(f"variant.magnet={magnet} needs its weight: set loss.magnet_coef > 0 (e.g. 0.2)")
        if magnet == "none" and coef != 0:
            raise ValueError(
                f"loss.magnet_coef={coef} weighs the pull toward variant.magnet, which is none: choose "
                "variant.magnet=uniform or snapshot (with variant.move_policy=legal_moves)"
            )
        evaluated = cfg.eval.get("move_policy", "text") if cfg.eval.enabled else policy
        if evaluated != policy:
            raise ValueError(
                f"eval.move_policy={evaluated} but variant.move_policy={policy}: the evaluation plays the policy as "
                "training does; set eval.move_policy=${variant.move_policy}"
            )

    def group(self, source=None) -> GroupShape:
        """At most: `games_per_group` games of one seed from one seat against one opponent, every one lasting
        `max_turns` moves or the game's longest game (the source's, or the bound source's), half of them the
        learner's, rounded up (each learner move is a rollout)."""
        s = self.settings
        source = source if source is not None else self.source
        longest = make_game(source.game).longest_game if isinstance(source, GameSeeds) else None
        learner_moves = math.ceil(min(s.max_turns, longest or s.max_turns) / 2)
        return GroupShape(
            rollouts=s.games_per_group * learner_moves,
            samples=f"{s.games_per_group} games of a seed from one seat (one rollout a learner move, at most "
            f"{learner_moves} a game)",
            keys=("variant.games_per_group", "variant.max_turns"),
            samples_per_prefix=1,  # one move of each game a call
            shared_prompt=False,
        )

    def bind_data(self, source, tokenizer, max_prompt_tokens: int) -> None:
        """The run's game source (data=games), tokenizer and prompt limit, given once by train.py."""
        self.source, self.tokenizer, self.max_prompt_tokens = source, tokenizer, max_prompt_tokens
        self.prompts = TurnPrompts(source, tokenizer, max_prompt_tokens)

    def bind_module(self, module: ScoresCompletions) -> None:
        """The training module, whose log-probs read the policy's moves: the `best_response` opponent's strategy
        and the draws over the legal moves."""
        self.module = module

    # ---- a round -----------------------------------------------------------------------------------------------
    def begin_round(self, round_index: int) -> None:
        super().begin_round(round_index)
        self.round_index, self._snapshot_taken, self._best_response = round_index, False, None
        self._counts = dict.fromkeys(("games", "wins", "draws", "losses", "turns", "illegal", "opp_moves_fixed",
                                      "capped", "extra_games", "prompts_cut", "payoff", "groups", "groups_alike"),
                                     0.0)  # fmt: skip
        self._moves = []

    def sample_rollouts(self, generator, prompts: Sequence, reward_fn, decode: Callable) -> list[Rollout]:
        if self.source is None:
            raise RuntimeError("variant=selfplay needs its game source: call bind_data first (train.py does)")
        generator = swapping_adapters(generator, "variant=selfplay")
        if not self._snapshot_taken:  # once a round, before its first game
            self._snapshot_taken = True
            if self.round_index % self.settings.snapshot_every == 0:
                self.pool.add_snapshot(f"round{self.round_index:03d}", generator.adapter_weights())
            refresh = self.round_index % self.settings.magnet_refresh == 0 or self.magnet_weights is None
            if self.settings.magnet == "snapshot" and refresh:  # None: a checkpoint of a run without one
                self.magnet_weights = generator.adapter_weights()
            if self.settings.move_policy == "legal_moves" and self.move_sampler is None:
                self.move_sampler = LegalMoveSampler(self.scorer("variant.move_policy=legal_moves"), self.tokenizer,
                                                     self.source.reply_prefix)  # fmt: skip
            if "best_response" in self.pool.fixed:
                self._best_response = self.best_response()
        matches = self.deal(generator, prompts)
        self.play(matches, generator, decode)
        for group_id, prompt in enumerate(prompts):  # a group whose learner never moved (possible in a game
            first = next(m for m in matches if m.group_id == group_id)  # whose opponent can end it first): more
            tries = 0  # of its games, same seed, seat and opponent, until it has a move
            while not any(m.turns for m in matches if m.group_id == group_id):
                tries += 1
                if tries > 8:
                    raise RuntimeError(f"{prompt.question}: the learner never got to move in 8 games")
                extra = self.match(
                    prompt, group_id, first.learner_seat, first.opponent, self.settings.games_per_group + tries
                )
                self.play([extra], generator, decode)
                matches.append(extra)
                self._counts["extra_games"] += 1
        self.pool.record_all_ranks([(m.opponent.name, m.learner_score) for m in matches])  # every rank's games
        rollouts = self.rollouts_of(matches, reward_fn, generator)
        # the round so far (dynamic sampling may call again), counted over every rank's games
        self.metrics.update(self.round_metrics(sum_counts_across_ranks(self._counts)))
        self.metrics.update(self.entropy_metrics())
        return rollouts

    def deal(self, generator, prompts: Sequence) -> list[Match]:
        """The matches of each prompt's group: one opponent and one seat a group, `games_per_group` games."""
        matches = []
        for group_id, prompt in enumerate(prompts):
            rng = random.Random(
                derive_seed(self.settings.seed, "selfplay", self.round_index, prompt.record.seed, group_id, 0)
            )
            opponent = self.player(self.pool.sample(rng), generator)
            seat = rng.randrange(2)
            matches += [self.match(prompt, group_id, seat, opponent, g) for g in range(self.settings.games_per_group)]
        return matches

    def match(self, prompt, group_id: int, seat: int, opponent: Player, game_index: int) -> Match:
        """Game `game_index` of a group, reset to the prompt's seed, with its own seeded draws."""
        seed = prompt.record.seed
        game = make_game(prompt.record.game_id)
        game.reset(seed)
        rng = random.Random(derive_seed(self.settings.seed, "game", self.round_index, seed, group_id, game_index, 0))
        return Match(game, seat, opponent, rng, group_id)

    def player(self, name: str, generator) -> Player:
        if name == LEARNER:
            return LEARNER_PLAYER
        if name in SCRIPTED or name == "best_response":
            scripted = self._best_response if name == "best_response" else SCRIPTED[name]()
            epsilon = self.settings.scripted_epsilon
            return NoisyPlayer(scripted, epsilon) if name in NOISY and epsilon > 0 else scripted
        if name == "base":
            return ModelPlayer("base", adapter_off(generator.adapter_weights()))
        return ModelPlayer(name, self.pool.snapshots[name])

    def best_response(self) -> BestResponsePlayer:
        """The exact best response to the policy as it is now: its strategy read from its move probabilities at
        every information set (games/policy_moves.py `policy_strategy`, the evaluator's path: one forward, no
        gradient, training's RNG untouched), answered by the game (`TwoPlayerGame.best_response`). Logs what the
        response wins, `game/exploitability` (the policy's at the start of the round). Every rank reads the same
        weights and gets the same table (a sharded policy's forward needs every rank: every rank calls it)."""
        game = make_game(self.source.game)
        strategy = policy_strategy(self.scorer("variant.fixed_opponents: 'best_response'"),
                                   lambda g, player: self.prompts.encode(g, player)[0], game, self.tokenizer,
                                   self.source.reply_prefix, self.terminator)  # fmt: skip
        self.metrics["game/exploitability"] = game.exploitability(strategy)
        return BestResponsePlayer(game.best_response(strategy))

    def scorer(self, what: str) -> ScoresCompletions:
        """The bound training module, which reads the policy's move probabilities; `what` needs it."""
        if self.module is None:
            raise RuntimeError(f"{what} reads the policy's probabilities: call bind_module first (train.py does)")
        return self.module

    @property
    def terminator(self) -> int | None:
        """What ends a move when the policy is read over the legal moves (`move_terminator`)."""
        return move_terminator(self.tokenizer, self.settings.move_policy)

    def play(self, matches: list[Match], generator, decode: Callable) -> None:
        def encode(game: TwoPlayerGame, player: int) -> list[int]:
            """The turn's prompt within `data.max_prompt_tokens` (`TurnPrompts`: old history left out, the rules and
            the current state kept), so prompt + completion stay within the context train.py checked; counted."""
            ids, dropped = self.prompts.encode(game, player)
            if dropped:
                self._counts["prompts_cut"] += 1
            return ids

        on_step = self._report if self.progress_listeners else None
        play(matches, generator, encode, decode, self.source.reply_prefix, self.settings.max_turns, on_step=on_step,
             move_sampler=self.move_sampler)  # fmt: skip

    def assign_advantages(self, rollouts: list[Rollout], reward_fn) -> None:
        """The game group's advantages (the reward pipeline's group transforms); with `variant.position_weight` w
        above 0, each turn's advantage also gains w x its reward against the other turns played from the same
        position in the round (GiGPO's step-level group, Feng et al. 2025, arXiv 2505.10978): a position is the
        exact prompt the move was drawn from, met on any rank; (r - mean) / (std + 1e-4) over its turns (the unbiased
        std, as the group transform's), 0 at a position met once or whose turns all scored alike. So a move is
        credited against the other moves from its position, not only against the other games of its group; the
        share of turns at a position met more than once is `game/repeated_position_frac`."""
        super().assign_advantages(rollouts, reward_fn)
        weight = self.settings.position_weight
        if weight == 0:
            return
        parts = gather_objects([(position_digest(r.prompt_ids), r.reward) for r in rollouts])
        every = [turn for part in parts for turn in part]
        offset = sum(len(part) for part in parts[: rank_and_world()[0]])  # this rank's turns in `every`
        ids: dict[str, int] = {}
        positions = torch.tensor([ids.setdefault(key, len(ids)) for key, _ in every], dtype=torch.long)  # [N]
        rewards = torch.tensor([reward for _, reward in every], dtype=torch.float64)  # [N]
        step = group_advantages(rewards, positions, "group")  # [N] against the same position's turns
        for i, r in enumerate(rollouts):
            r.advantage += weight * float(step[offset + i])
        met = torch.bincount(positions)  # [P] turns at each position
        self.metrics["game/repeated_position_frac"] = float((met[positions] > 1).double().mean()) if every else 0.0

    def rollouts_of(self, matches: list[Match], reward_fn, generator) -> list[Rollout]:
        magnets = iter(self.magnet_logprobs([t for m in matches for t in m.turns], generator))
        rollouts = []
        for m in matches:
            score = m.learner_score
            for turn_index, turn in enumerate(m.turns):
                record = TurnRecord(m.game.game_id, m.learner_seat, turn_index, turn.move, turn.illegal, score,
                                    m.opponent.name, len(m.turns), m.learner_payoff)  # fmt: skip
                rollout = self.scored_rollout(
                    turn.prompt_ids, turn.completion, turn.reply, "", m.group_id, reward_fn, record=record
                )
                magnet = next(magnets)
                if turn.choice is not None:
                    rollout.move_choice = dataclasses.replace(turn.choice, magnet_logprobs=magnet)
                rollouts.append(rollout)
            self._count(m)
            self._moves += [(position_digest(t.prompt_ids), t.move) for t in m.turns]
        alike, groups = groups_alike((m.group_id, m.learner_score) for m in matches if m.turns)
        self._counts["groups_alike"] += alike
        self._counts["groups"] += groups
        return rollouts

    def magnet_logprobs(self, turns: Sequence[LearnerTurn], generator) -> list[tuple[float, ...] | None]:
        """The magnet's log-probs over each turn's legal moves (`variant.magnet`), or None each without a magnet:
        uniform, -log K; a snapshot, read from its weights (one batched read of every turn, inside the engine's
        `sampling_from`, the weights the learner's moves are scored under swapped for the magnet's)."""
        if self.settings.magnet == "none":
            return [None] * len(turns)
        if self.settings.magnet == "uniform":
            return [tuple([-math.log(len(t.choice.alternatives))] * len(t.choice.alternatives)) for t in turns]
        with generator.sampling_from(self.magnet_weights):
            found = self.move_sampler.log_distributions([t.prompt_ids for t in turns],
                                                        [t.choice.alternatives for t in turns])  # fmt: skip
        return [tuple(logq.tolist()) for logq in found]

    # ---- counting -----------------------------------------------------------------------------------------------
    def _count(self, m: Match) -> None:
        c = self._counts
        score = m.learner_score
        c["games"] += 1
        c["wins" if score > 0 else "losses" if score < 0 else "draws"] += 1
        c["turns"] += len(m.turns)
        c["illegal"] += sum(t.illegal for t in m.turns)
        c["opp_moves_fixed"] += m.opponent_illegal
        c["capped"] += m.capped
        c["payoff"] += m.learner_payoff

    def round_metrics(self, counts: dict[str, float] | None = None) -> dict[str, float]:
        """The round's `game/...` metrics from `counts` (default: this rank's own), and the pool's `pool/...`.
        `sample_rollouts` passes the counts summed over ranks, so the rates are over every rank's games and every
        rank reports the same values, as it does the pool's (one pool, the same on every rank)."""
        c = self._counts if counts is None else counts
        games, turns = max(c["games"], 1.0), max(c["turns"], 1.0)
        return {
            "game/games": c["games"],
            "game/win_rate": c["wins"] / games,
            "game/draw_rate": c["draws"] / games,
            "game/loss_rate": c["losses"] / games,
            "game/payoff_mean": c["payoff"] / games,
            "game/illegal_move_rate": c["illegal"] / turns,
            "game/learner_turns_mean": c["turns"] / games,
            "game/opponent_moves_replaced": c["opp_moves_fixed"],
            "game/draws_at_max_turns": c["capped"],
            "game/extra_games": c["extra_games"],
            "game/prompts_cut": c["prompts_cut"],
            "game/groups_alike_frac": c["groups_alike"] / max(c["groups"], 1.0),
            **self.pool.metrics(),
        }

    def entropy_metrics(self) -> dict[str, float]:
        """`game/move_entropy`, the mean entropy of the moves the learner chose at a position (`move_entropy`: the
        position is the exact prompt a move was sampled from), over the round's turns on every rank (gathered: the
        same position may be met on several), and `game/move_entropy_turns`, the turns it is the mean of."""
        entropy, turns = move_entropy(move for part in gather_objects(self._moves) for move in part)
        return {"game/move_entropy": entropy, "game/move_entropy_turns": float(turns)}

    def _report(self, matches: Sequence[Match]) -> None:
        finished = [m for m in matches if m.done]
        scores = [m.learner_score for m in finished]
        turns = [t for m in matches for t in m.turns]
        progress = SelfPlayProgress(
            round_index=self.round_index,
            game_id=matches[0].game.game_id if matches else "",
            games_total=len(matches),
            games_finished=len(finished),
            wins=sum(s > 0 for s in scores),
            draws=sum(s == 0 for s in scores),
            losses=sum(s < 0 for s in scores),
            learner_turns=len(turns),
            illegal_moves=sum(t.illegal for t in turns),
            pool=self.pool.entries(),
        )
        for listener in self.progress_listeners:
            listener(progress)

    # ---- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        magnet = None if self.magnet_weights is None else dict(self.magnet_weights)
        return {"pool": self.pool.state_dict(), "magnet": magnet}

    def load_state_dict(self, state: dict) -> None:
        if "pool" not in state:
            raise ValueError("ckpt_path: the checkpoint holds no self-play pool (written by another variant?)")
        self.pool.load_state_dict(state["pool"])
        magnet = state.get("magnet")
        self.magnet_weights = None if magnet is None else dict(magnet)
