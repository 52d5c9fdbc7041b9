"""Self-play's `best_response` opponent (variant.fixed_opponents): every round it reads the policy's Kuhn Poker
strategy from the training module's log-probs and plays the exact best response to it.

Truths: a stand-in module whose move probabilities are chosen here (tests/unit/test_kuhn_exploitability_eval.py
`WeightsModule`), so the strategy the opponent must answer is known; the best response to it is
`best_response_strategy`, checked against a brute force over every pure strategy in test_kuhn_exploitability.py,
and worked out by hand below for the policy that always bets and calls. The learner's own moves come from a
scripted engine (it bets or calls), so the games show the opponent's replies alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from grpo_lightning.data.games import GameSeed, GameSeeds
from grpo_lightning.games.kuhn_poker import DEALS, INFOSETS, KuhnPoker, best_response_strategy, exploitability
from grpo_lightning.games.play import BestResponsePlayer
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.types import Prompt
from grpo_lightning.variants.selfplay import SelfPlay
from tests.unit.test_kuhn_exploitability_eval import WeightsModule, normalised
from tests.unit.test_selfplay import MoveEngine, bet_or_call

REWARD = {"terms": {"payoff": {"_target_": "grpo_lightning.rewards.games.GamePayoff"}}}


def always_bet_and_call() -> dict:
    """The policy's move weights (unnormalised, a floor for 'never': log 0 is not a log-prob): bet and call."""
    return {(card, h): ({"call": 1.0, "fold": 1e-300} if h.endswith("bet") else {"bet": 1.0, "check": 1e-300})
            for card, h in INFOSETS}  # fmt: skip


def kuhn_round(tokenizer, module, seeds: int = 16, **settings):
    """One round of `seeds` deals against the best response, the learner betting or calling; the variant and the
    matches it played."""
    v = SelfPlay(games_per_group=2, fixed_opponents=["best_response"], max_turns=3, **settings)
    v.bind_data(GameSeeds(game="kuhn_poker"), tokenizer, 512)
    v.bind_module(module)
    v.begin_round(0)
    played = []
    original = v.play

    def keep(matches, generator, decode):
        original(matches, generator, decode)
        played.extend(matches)

    v.play = keep
    prompts = [Prompt([], "", f"kuhn seed {s}", s, record=GameSeed("kuhn_poker", s)) for s in range(seeds)]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    v.generate_rollouts(MoveEngine(tokenizer, bet_or_call), prompts, build_reward(REWARD), decode)
    return v, played


def test_the_opponent_answers_the_policys_strategy_read_from_the_module(tokenizer):
    """By hand, against always bet and call: from the second seat the best response calls a bet with a K (+2) or
    a Q (0, against -1 for folding) and folds a J (-1 against -2); from the first seat, checking a J and folding to
    the bet loses 1 where betting loses 2. Every move the opponent made is one the best response plays there,
    the round logs the policy's exploitability, and reading it moved no random state."""
    weights = always_bet_and_call()
    module = WeightsModule(tokenizer, weights)
    strategy = normalised(weights)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    v, matches = kuhn_round(tokenizer, module)
    assert torch.equal(torch.get_rng_state(), state)
    assert module.modes_seen == [False]  # one forward a round, in eval mode
    assert v.metrics["game/exploitability"] == pytest.approx(exploitability(strategy), abs=1e-12)
    answer = best_response_strategy(strategy)
    assert answer[2, "bet"] == {"call": 1.0} and answer[1, "bet"] == {"call": 1.0} and answer[0, "bet"] == {"fold": 1.0}
    assert answer[0, "check,bet"] == {"fold": 1.0}
    seats = set()
    for m in (m for m in matches if m.opponent.name == "best_response"):  # the others: round 0's snapshot
        game = KuhnPoker()
        game.reset(DEALS.index(m.game.cards))  # the same deal, replayed move by move
        for move in m.game.history:
            if game.current_player != m.learner_seat:
                assert answer[game.information_set()][move] > 0, (game.information_set(), move)
                seats.add(game.current_player)
            game.step(f"[{move}]")
    assert seats == {0, 1}  # both seats were answered
    assert v.metrics["pool/mu_best_response"] != pytest.approx(25.0)  # rated as it played


def test_the_opponent_is_made_once_a_round_and_plays_its_table(tokenizer):
    """A second sampling call of the same round (dynamic sampling) reuses the round's response; the next round reads
    the policy again. The player's draws follow its table: a mixed entry, drawn many times, in proportion."""
    module = WeightsModule(tokenizer, always_bet_and_call())
    v, _ = kuhn_round(tokenizer, module, seeds=2)
    first = v._best_response
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompts = [Prompt([], "", "kuhn seed 7", 7, record=GameSeed("kuhn_poker", 7))]
    v.generate_rollouts(MoveEngine(tokenizer, bet_or_call), prompts, build_reward(REWARD), decode)
    assert v._best_response is first and module.modes_seen == [False]
    v.begin_round(1)
    v.generate_rollouts(MoveEngine(tokenizer, bet_or_call), prompts, build_reward(REWARD), decode)
    assert module.modes_seen == [False, False]
    player = BestResponsePlayer({(1, "check"): {"[bet]": 0.25, "[check]": 0.75}})
    game = KuhnPoker()
    game.reset(next(s for s, deal in enumerate(DEALS) if deal[1] == 1))
    game.step("[check]")
    rng = random.Random(0)
    bets = sum(player.choose(game, rng) == "[bet]" for _ in range(4000))
    assert abs(bets / 4000 - 0.25) < 0.03


def test_without_the_module_the_round_says_what_is_missing(tokenizer):
    v = SelfPlay(games_per_group=2, fixed_opponents=["best_response"], max_turns=3)
    v.bind_data(GameSeeds(game="kuhn_poker"), tokenizer, 512)
    v.begin_round(0)
    prompts = [Prompt([], "", "kuhn seed 0", 0, record=GameSeed("kuhn_poker", 0))]
    with pytest.raises(RuntimeError, match="bind_module"):
        v.generate_rollouts(MoveEngine(tokenizer, bet_or_call), prompts, build_reward(REWARD), lambda ids: "")


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["experiment=selfplay_tictactoe", "variant.fixed_opponents=[random,best_response]"],
         "variant.fixed_opponents: 'best_response' answers"),
        (["experiment=selfplay_kuhn", "eval.opponents=[random,best_response]"],
         "eval.opponents: 'best_response' is a training opponent"),
        (["experiment=selfplay_tictactoe", "eval.exact_opponents=[best_response]"], "eval.exact_opponents"),
    ],
)  # fmt: skip
def test_where_it_cannot_play_the_config_check_names_the_key(tmp_path, overrides, words):
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg

    with pytest.raises(ValueError) as err:
        build_run(make_cfg(tmp_path, [*overrides, "model=tiny"]))
    assert words in str(err.value)
