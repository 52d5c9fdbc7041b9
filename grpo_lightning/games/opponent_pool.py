"""The opponents of self-play: the policy's own LoRA snapshots, the base model and scripted players, rated.

Ratings are openskill's Thurstone-Mosteller model (the TrueSkill family: a mean `mu` and an uncertainty `sigma`
per player; Joshy 2024, openskill.py), updated after every game between the learner and its opponent, in the
order the games were dealt. Under several processes there is one pool: every rank applies every rank's results,
rank 0's first, then rank 1's, each rank's in its own order (`record_all_ranks`), so every rank holds the same
ratings after every batch of games. A snapshot enters the pool with the learner's rating at that moment. Everything is
plain numbers and CPU tensors, saved in every checkpoint and restored exactly (the rating objects are rebuilt
from `mu` and `sigma`).

Sampling modes (`variant.opponent_sampling`, docs/selfplay.md): `mirror` (the current policy), `lagged` (uniform
over the newest `lagged_window` snapshots), `random` (uniform over snapshots and the fixed opponents), and the
rating-aware `match_quality` (weights proportional to the model's probability of a draw against the learner: the
opponents closest in strength are played most, as TrueSkill's match quality does). Each draw uses a seeded
`random.Random` of the variant's, never a global random state.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from grpo_lightning.distributed import in_rank_order
from grpo_lightning.games.progress import PoolEntry
from grpo_lightning.schema import strings

LEARNER = "learner"
FIXED_OPPONENTS = ("random", "tactic", "perfect", "best_response", "base")
"""Opponents that are not snapshots: a random legal move, one-move tactics (win, else block, else random; games that
list winning moves), minimax play (solved games only), the exact best response to the policy of the round (games
that compute one), the base model."""
SAMPLING_MODES = ("mirror", "lagged", "random", "match_quality")


def opponent_names(value) -> str | None:
    """A rule: a list of fixed opponents."""
    problem = strings(value)
    if problem is not None or isinstance(value, str):
        return f"must be a list of {', '.join(FIXED_OPPONENTS)}"
    unknown = [v for v in value if v not in FIXED_OPPONENTS]
    if unknown:
        return f"must name only {', '.join(FIXED_OPPONENTS)} ({unknown[0]!r} is none of them)"
    if len(set(value)) != len(value):
        return "must not name an opponent twice"
    return None


def rating_model():
    from openskill.models import ThurstoneMostellerFull

    return ThurstoneMostellerFull()


@dataclass
class Rating:
    mu: float
    sigma: float
    games: int = 0


class OpponentPool:
    def __init__(self, sampling: str, fixed: tuple[str, ...], max_snapshots: int, lagged_window: int) -> None:
        self.sampling, self.fixed = sampling, tuple(fixed)
        self.max_snapshots, self.lagged_window = max_snapshots, lagged_window
        self.model = rating_model()
        start = self.model.rating()
        self.ratings: dict[str, Rating] = {name: Rating(start.mu, start.sigma) for name in (LEARNER, *self.fixed)}
        self.snapshots: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        """Snapshot name -> the adapter's weights (CPU), oldest first."""

    # ---- membership --------------------------------------------------------------------------------------------
    def add_snapshot(self, name: str, weights: dict[str, Tensor]) -> None:
        """A snapshot of the learner joins with the learner's rating; the oldest beyond `max_snapshots` leave."""
        learner = self.ratings[LEARNER]
        self.snapshots[name] = weights
        self.ratings[name] = Rating(learner.mu, learner.sigma)
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)

    def candidates(self) -> list[str]:
        """Who `random` and `match_quality` choose from: the snapshots in the pool, then the fixed opponents."""
        return [*self.snapshots, *self.fixed]

    # ---- choosing ------------------------------------------------------------------------------------------------
    def sample(self, rng: random.Random) -> str:
        if self.sampling == "mirror":
            return LEARNER
        if self.sampling == "lagged":
            recent = list(self.snapshots)[-self.lagged_window :]
            return rng.choice(recent) if recent else LEARNER
        candidates = self.candidates()
        if not candidates:
            return LEARNER
        if self.sampling == "random":
            return rng.choice(candidates)
        weights = [self.draw_probability(name) for name in candidates]
        return rng.choices(candidates, weights=weights, k=1)[0]

    def draw_probability(self, name: str) -> float:
        """The rating model's probability that the learner and `name` draw (match quality, in (0, 1])."""
        return float(self.model.predict_draw([[self._rating(LEARNER)], [self._rating(name)]]))

    # ---- results -------------------------------------------------------------------------------------------------
    def record(self, opponent: str, learner_score: float) -> None:
        """One game's result (+1 the learner won, 0 draw, -1 lost): both ratings move (mirror games: neither)."""
        self.ratings[opponent].games += 1
        if opponent == LEARNER:
            return
        ranks = [0, 1] if learner_score > 0 else [1, 0] if learner_score < 0 else [0, 0]
        [[learner], [other]] = self.model.rate([[self._rating(LEARNER)], [self._rating(opponent)]], ranks=ranks)
        for name, new in ((LEARNER, learner), (opponent, other)):
            self.ratings[name].mu, self.ratings[name].sigma = float(new.mu), float(new.sigma)

    def record_all_ranks(self, results: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
        """This rank's games, `(opponent, learner's score)` in the order they were dealt, recorded with every
        other rank's: all ranks' results in rank order, then each rank's own order, applied on every rank (a
        collective: every rank calls it once per batch of games). Why all of them, in one order: a rating update
        depends on the ratings before it, so ranks applying only their own games, or the same games in different
        orders, would hold different pools and draw rating-aware opponents from different ratings. One process
        records its own by the same path. Returns the results applied, in their order."""
        applied = in_rank_order([(str(opponent), float(score)) for opponent, score in results])
        for opponent, score in applied:
            self.record(opponent, score)
        return applied

    def _rating(self, name: str):
        rating = self.ratings[name]
        return self.model.rating(mu=rating.mu, sigma=rating.sigma, name=name)

    # ---- reporting and state ------------------------------------------------------------------------------------
    def entries(self) -> tuple[PoolEntry, ...]:
        """The learner, the opponents in the pool now, with their ratings and games."""
        names = [LEARNER, *self.candidates()]
        return tuple(PoolEntry(n, self.ratings[n].mu, self.ratings[n].sigma, self.ratings[n].games) for n in names)

    def metrics(self) -> dict[str, float]:
        """`pool/...`: its size, each member's rating mean, the learner's uncertainty."""
        metrics = {"pool/size": float(len(self.snapshots)), "pool/learner_sigma": self.ratings[LEARNER].sigma}
        metrics |= {f"pool/mu_{entry.name}": entry.mu for entry in self.entries()}
        return metrics

    def state_dict(self) -> dict:
        return {
            "ratings": {name: (r.mu, r.sigma, r.games) for name, r in self.ratings.items()},
            "snapshots": OrderedDict((name, dict(w)) for name, w in self.snapshots.items()),
        }

    def load_state_dict(self, state: dict) -> None:
        self.ratings = {name: Rating(mu, sigma, games) for name, (mu, sigma, games) in state["ratings"].items()}
        self.snapshots = OrderedDict((name, dict(w)) for name, w in state["snapshots"].items())
