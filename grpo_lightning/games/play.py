"""Playing a batch of two-player games in lockstep on one engine (self-play's rounds and its evaluation).

Every game of the batch advances one move per step. The model players' moves of a step are sampled together:
one batched `generate` for every game where the learner (or its mirror) is to move, and one per other model
opponent (a snapshot or the base model, sampled through `SwapsAdapters.sampling_from`); scripted players move
from their own seeded `random.Random`. Only the learner's turns are recorded, each as the exact prompt it was
sampled from (the chat template, the observation and the reply prefix) and its reply. With a `MoveSampler`
(`variant.move_policy=legal_moves`) the model players draw their moves over the legal moves instead of writing
text: one batched read of every legal move per model player and step, each draw from the match's own generator.

An opponent's illegal move is replaced by a random legal move when the game lists its legal moves (counted in
`opponent_illegal`): a weak opponent that lost on its first move would leave the learner nothing to play, and
what the learner should learn is to beat moves, not to wait for mistakes. The learner's illegal move ends the game
as a loss. A game still going after `max_turns` moves is a draw.

`BestResponsePlayer` plays a table: the exact best response to the policy that a game with an exact solver
computes. `NoisyPlayer` makes a scripted player blunder at random with a set probability (self-play's
`scripted_epsilon`); `groups_alike` and `move_entropy` measure how much a round's games and moves vary
(docs/selfplay.md, "Keeping the spread").
"""

from __future__ import annotations

import contextlib
import math
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from grpo_lightning.games.base import TwoPlayerGame, bracketed_move
from grpo_lightning.types import Completion, MoveChoice


class PlayingEngine(Protocol):
    """What lockstep play needs of an engine: sampling, and sampling from other adapter weights for a while (the
    engines' `SwapsAdapters`, generation/adapters.py, which the variant and the evaluator ask for before playing)."""

    def generate(
        self, prefixes: list[list[int]], num_samples: int, max_new_tokens: int | None = None
    ) -> list[list[Completion]]: ...

    def sampling_from(self, weights: dict[str, Tensor]) -> AbstractContextManager[None]: ...


MOVE_POLICIES = ("text", "legal_moves")
"""How model players move (`variant.move_policy`, `eval.move_policy`; docs/selfplay.md, "Moves over the legal
moves"): `text`, sampled as free text and read for its move; `legal_moves`, drawn from the policy's distribution
over the legal moves (`MoveSampler`), which the learner trains on (the loss, its entropy and its KLs exact over
moves)."""


@dataclass(frozen=True)
class MovePick:
    """A move drawn from a model player's distribution over the legal moves (`MoveSampler`)."""

    move: str
    """The move as the game reads it (`[4]`)."""
    completion: Completion
    """The move's tokens after the prompt (its text less the reply prefix, and the terminator), with their
    log-probs: what the model wrote, as a sampled completion."""
    choice: MoveChoice
    """The legal moves it was drawn among and the chosen one's probability (the learner trains on them)."""


class MoveSampler(Protocol):
    """Draws each model player's move from its distribution over the legal moves instead of sampling free text
    (self-play's `variant.move_policy=legal_moves`; games/policy_moves.py `LegalMoveSampler`). It reads the
    weights the engine samples from at the time (a snapshot's inside `sampling_from`)."""

    def sample(self, prompts: list[list[int]], legal: list[list[str]], rngs: list[random.Random]) -> list[MovePick]: ...


class Player(ABC):
    name: str


class ModelPlayer(Player):
    """The policy sampled through `weights` (an adapter snapshot, or the base model's); None: the engine's own
    current weights (the learner, and its mirror)."""

    def __init__(self, name: str, weights: dict[str, Tensor] | None = None) -> None:
        self.name, self.weights = name, weights


class ScriptedPlayer(Player):
    """A player whose move is drawn from an exact distribution over the position's moves (`move_distribution`), so
    its expected results can be computed as well as sampled (games/exact.py)."""

    @abstractmethod
    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        """Each move this player may make in the position of `game` (in the game's format), with its probability."""

    def choose(self, game: TwoPlayerGame, rng: random.Random) -> str:
        """The reply of this player to the position of `game`, drawn from `move_distribution` with `rng`."""
        moves = self.move_distribution(game)
        return rng.choices(list(moves), weights=list(moves.values()))[0] if len(moves) > 1 else next(iter(moves))


def _uniform(moves: Sequence[str]) -> dict[str, float]:
    return {move: 1.0 / len(moves) for move in moves}


class RandomMovePlayer(ScriptedPlayer):
    """A uniformly random legal move."""

    name = "random"

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        moves = game.legal_moves()
        if not moves:
            raise ValueError(f"{game.game_id} does not list its legal moves: the random player cannot play it")
        return _uniform(moves)

    def choose(self, game: TwoPlayerGame, rng: random.Random) -> str:
        return rng.choice(list(self.move_distribution(game)))  # the draw every earlier run made


class PerfectPlayer(ScriptedPlayer):
    """Perfect play (solved games only): a uniformly random move among those minimax allows (TicTacToe), or the
    equilibrium's mixed move (Kuhn Poker)."""

    name = "perfect"

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        return game.optimal_distribution()

    def choose(self, game: TwoPlayerGame, rng: random.Random) -> str:
        moves = self.move_distribution(game)
        if len(set(moves.values())) == 1:
            return rng.choice(list(moves))  # uniform: the draw every earlier run made
        return super().choose(game, rng)


class TacticPlayer(ScriptedPlayer):
    """Win if a move wins now, else block a move with which the opponent would win next, else a random legal move
    (each choice uniform among its moves): the one-move tactics a player needs before any strategy. Games that list
    their winning moves only (`TwoPlayerGame.winning_moves`: TicTacToe)."""

    name = "tactic"

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        me = game.current_player
        return _uniform(game.winning_moves(me) or game.winning_moves(1 - me) or game.legal_moves())


class BestResponsePlayer(ScriptedPlayer):
    """The exact best response to a strategy of the policy's (`TwoPlayerGame.best_response`: games that compute one,
    Kuhn Poker), played from its table: at each information set, uniform over the moves that win the most against
    the policy (exploitability descent's opponent, Lockhart et al. 2019). Self-play makes it anew every round from
    the policy's move probabilities (variants/selfplay.py), so it is always the opponent the policy loses most to."""

    name = "best_response"

    def __init__(self, table: Mapping[Hashable, Mapping[str, float]]) -> None:
        self.table = table

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        return dict(self.table[game.information_set()])


SCRIPTED = {"random": RandomMovePlayer, "perfect": PerfectPlayer, "tactic": TacticPlayer}
NOISY = ("perfect", "tactic", "best_response")
"""The scripted players `variant.scripted_epsilon` makes noisy in training (`random` is random already)."""


class NoisyPlayer(ScriptedPlayer):
    """`inner` that plays a uniformly random legal move with probability `epsilon` (an epsilon-greedy opponent:
    `perfect` or `tactic` that sometimes blunders, so games against it vary). Its name is `inner`'s (the pool rates
    it under that name). At `epsilon` 0 it is `inner`, draw for draw; at 1 the random player's distribution."""

    def __init__(self, inner: ScriptedPlayer, epsilon: float) -> None:
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1] (got {epsilon!r})")
        self.inner, self.epsilon, self.name = inner, float(epsilon), inner.name

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        """(1 - epsilon) x `inner`'s distribution + epsilon x uniform over the legal moves."""
        inner = self.inner.move_distribution(game)
        if self.epsilon == 0.0:
            return inner
        legal = game.legal_moves()
        mixed = {move: self.epsilon / len(legal) for move in legal}
        for move, p in inner.items():
            mixed[move] = mixed.get(move, 0.0) + (1.0 - self.epsilon) * p
        return mixed

    def choose(self, game: TwoPlayerGame, rng: random.Random) -> str:
        """One draw of `rng` decides (none at epsilon 0), then the random move's draw or `inner`'s own."""
        if self.epsilon > 0.0 and rng.random() < self.epsilon:
            return rng.choice(game.legal_moves())
        return self.inner.choose(game, rng)


@dataclass
class LearnerTurn:
    """One move of the learner: the prompt it was sampled from and what it replied."""

    prompt_ids: list[int]
    completion: Completion
    reply: str
    """`reply_prefix` + the decoded completion: the text the game was given."""
    move: str | None
    illegal: bool
    choice: MoveChoice | None = None
    """The legal moves the move was drawn among (a `MoveSampler`'s); None: sampled as free text."""


@dataclass
class Match:
    """One game of the batch: the learner in `learner_seat` against `opponent`."""

    game: TwoPlayerGame
    learner_seat: int
    opponent: Player
    rng: random.Random
    """The scripted opponent's draws and the substitutes for an opponent's illegal moves."""
    group_id: int = 0
    turns: list[LearnerTurn] = field(default_factory=list)
    moves: int = 0
    opponent_illegal: int = 0
    capped: bool = False
    """Called a draw at `max_turns`."""

    @property
    def done(self) -> bool:
        return self.capped or self.game.done

    @property
    def learner_score(self) -> float:
        """+1 the learner won, 0 draw, -1 lost (once done)."""
        if self.capped:
            return 0.0
        return self.game.outcome[self.learner_seat]

    @property
    def learner_payoff(self) -> float:
        """The learner's payoff in the game's unit (`TwoPlayerGame.payoff`; the outcome where that is all), 0 for a
        game called a draw at `max_turns` (once done)."""
        if self.capped:
            return 0.0
        return self.game.payoff[self.learner_seat]


LEARNER_PLAYER = ModelPlayer("learner")


def play(
    matches: Sequence[Match],
    engine: PlayingEngine,
    encode: Callable[[TwoPlayerGame, int], list[int]],
    decode: Callable[[list[int]], str],
    reply_prefix: str,
    max_turns: int,
    max_new_tokens: int | None = None,
    on_step: Callable[[Sequence[Match]], None] | None = None,
    move_sampler: MoveSampler | None = None,
) -> None:
    """Play every match to its end, in lockstep (`encode(game, player)`: the prompt ids of that player's turn,
    data/games.py `TurnPrompts`; `on_step` is called after every move of the batch, for progress). With
    `move_sampler`, model players draw their moves over the legal moves (each from its match's `rng`) instead of
    writing text."""
    while True:
        active = [m for m in matches if not m.done]
        if not active:
            return
        learners = {id(m) for m in active if m.game.current_player == m.learner_seat}
        movers = {id(m): (LEARNER_PLAYER if id(m) in learners else m.opponent) for m in active}
        replies: dict[int, tuple[str, list[int] | None, Completion | None]] = {}
        choices: dict[int, MoveChoice] = {}
        model_groups: dict[str, list[Match]] = {}
        weights_of: dict[str, dict[str, Tensor] | None] = {}
        for m in active:
            player = movers[id(m)]
            if isinstance(player, ModelPlayer):
                model_groups.setdefault(player.name, []).append(m)
                weights_of[player.name] = player.weights
            else:
                replies[id(m)] = (player.choose(m.game, m.rng), None, None)
        for name in sorted(model_groups, key=lambda n: (n != "learner", n)):  # the learner's batch first
            group, weights = model_groups[name], weights_of[name]
            prompts = [encode(m.game, m.game.current_player) for m in group]
            swap = engine.sampling_from(weights) if weights is not None else contextlib.nullcontext()
            if move_sampler is not None:
                with swap:
                    picks = move_sampler.sample(prompts, [m.game.legal_moves() for m in group], [m.rng for m in group])
                for m, prompt, pick in zip(group, prompts, picks, strict=True):
                    replies[id(m)], choices[id(m)] = (pick.move, prompt, pick.completion), pick.choice
                continue
            with swap:
                completions = [c[0] for c in engine.generate(prompts, 1, max_new_tokens)]
            for m, prompt, completion in zip(group, prompts, completions, strict=True):
                replies[id(m)] = (reply_prefix + decode(completion.token_ids), prompt, completion)
        for m in active:
            reply, prompt, completion = replies[id(m)]
            is_learner = id(m) in learners  # a mirror opponent is the policy too, but not the learner's seat
            legal = m.game.legal_moves()
            result = m.game.step(reply) if is_learner or not legal else _opponent_step(m, reply, legal)
            if is_learner:
                turn = LearnerTurn(prompt, completion, reply, bracketed_move(reply), result.illegal, choices.get(id(m)))
                m.turns.append(turn)
            m.moves += 1
            if not m.game.done and m.moves >= max_turns:
                m.capped = True
        if on_step is not None:
            on_step(matches)


def _opponent_step(match: Match, reply: str, legal: list[str]):
    """An opponent's move; an illegal one is replaced by a random legal move (counted)."""
    move = bracketed_move(reply)
    if move is None or move not in legal:
        match.opponent_illegal += 1
        reply = match.rng.choice(legal)
    return match.game.step(reply)


# ---- spread: how much a round's games and moves vary ------------------------------------------------------------
def groups_alike(results: Iterable[tuple[int, float]]) -> tuple[int, int]:
    """(groups whose games all ended with one result, groups) of a round's `(group id, learner's result)` pairs, one
    a game. A group whose games all ended alike has no spread of outcomes for GRPO to learn from."""
    seen: dict[int, set[float]] = {}
    for group, score in results:
        seen.setdefault(group, set()).add(score)
    return sum(len(scores) == 1 for scores in seen.values()), len(seen)


def move_entropy(moves: Iterable[tuple[Hashable, str | None]]) -> tuple[float, int]:
    """(the mean entropy in nats, turns counted) of the moves chosen at each position, from `(position, move)` pairs,
    one a turn. A position's entropy is that of the empirical distribution of the moves chosen there (no move,
    None, is an outcome of its own); the mean is over the turns at positions met at least twice (one turn shows no
    spread), so a position weighs by its turns. 0.0 when no position was met twice."""
    by_position: dict[Hashable, Counter] = {}
    for position, move in moves:
        by_position.setdefault(position, Counter())[move] += 1
    total, turns = 0.0, 0
    for counts in by_position.values():
        n = sum(counts.values())
        if n < 2:
            continue
        total += -sum(c * math.log(c / n) for c in counts.values())  # n x the position's entropy
        turns += n
    return (total / turns if turns else 0.0), turns
