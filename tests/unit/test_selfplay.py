"""Self-play's parts against independent truths: TicTacToe's rules and its game tree, the perfect player, the rated
pool against openskill called directly, lockstep play on a scripted engine, a round's rollouts and rewards worked
out by hand, the evaluator's determinism, and the HF engine's adapter swaps against peft's own switch."""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_lightning.data.games import GameSeed, GameSeeds
from grpo_lightning.games import make_game
from grpo_lightning.games.exact import both_seats
from grpo_lightning.games.kuhn_poker import KuhnPoker
from grpo_lightning.games.opponent_pool import LEARNER, OpponentPool, rating_model
from grpo_lightning.games.play import (
    LEARNER_PLAYER,
    Match,
    ModelPlayer,
    PerfectPlayer,
    RandomMovePlayer,
    ScriptedPlayer,
    play,
)
from grpo_lightning.games.tictactoe import minimax_value
from grpo_lightning.generation import SwapsAdapters
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.models.lora import adapter_off
from grpo_lightning.rewards.games import GameOutcome, GamePayoff, LegalMove, MoveFormat
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.rewards.transforms import BatchNormalize, RoleBaseline
from grpo_lightning.training.evaluation import wilson_interval
from grpo_lightning.training.game_evaluation import GameEvaluator
from grpo_lightning.types import Completion, Prompt, TurnRecord
from grpo_lightning.variants.selfplay import SelfPlay
from tests.helpers import StubGenerator, lora_policy_with_random_adapters


# ---- TicTacToe ---------------------------------------------------------------------------------------------------
def play_moves(moves: list[str]):
    game = make_game("tictactoe")
    game.reset(0)
    results = [game.step(m) for m in moves]
    return game, results


def test_tictactoe_rules_by_hand():
    game, results = play_moves(["[0]", "[3]", "[1]", "[4]", "[2]"])  # X: 0 1 2, a row
    assert results[-1].done and game.outcome == (1.0, -1.0) and not any(r.illegal for r in results)
    game, _ = play_moves(["[0]", "[3]", "[1]", "[4]", "[8]", "[5]"])  # O: 3 4 5
    assert game.outcome == (-1.0, 1.0)
    game, _ = play_moves(["[0]", "[1]", "[2]", "[4]", "[3]", "[5]", "[7]", "[6]", "[8]"])  # full, no line
    assert game.outcome == (0.0, 0.0)
    for reply in ("[4] then", "I play [ 4 ]"):  # a move anywhere in the reply, spaces inside allowed
        assert not play_moves([reply])[1][0].illegal
    for bad in (["[9]"], ["four"], ["[4]", "[4]"], ["[x]"]):  # off the board, no move, occupied, not a cell
        game, results = play_moves(bad)
        mover = (len(bad) - 1) % 2
        assert results[-1].illegal and results[-1].done
        assert game.outcome[mover] == -1.0 and game.outcome[1 - mover] == 1.0


def test_the_game_tree_has_5478_positions_and_perfect_play_draws():
    """The count of legal positions reachable from the empty board is a known number (5,478); reached here by
    stepping the game itself, independently of the minimax."""
    seen, frontier = set(), [[]]
    while frontier:
        moves = frontier.pop()
        game, _ = play_moves(moves)
        if game.board in seen:
            continue
        seen.add(game.board)
        if not game.done:
            frontier.extend(moves + [m] for m in game.legal_moves())
    assert len(seen) == 5478
    assert minimax_value(".........", 0) == 0  # TicTacToe is a draw


def test_the_perfect_player_never_loses_and_draws_itself():
    rng = random.Random(0)
    perfect, rand = PerfectPlayer(), RandomMovePlayer()
    for game_index in range(200):
        seat = game_index % 2
        game = make_game("tictactoe")
        game.reset(game_index)
        while not game.done:
            player = perfect if game.current_player == seat else rand
            game.step(player.choose(game, rng))
        assert game.outcome[seat] >= 0
    for _ in range(20):
        game = make_game("tictactoe")
        game.reset(0)
        while not game.done:
            game.step(perfect.choose(game, rng))
        assert game.outcome == (0.0, 0.0)


def test_games_never_touch_the_global_random_states():
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    rng = random.Random(1)
    game = make_game("tictactoe")
    game.reset(3)
    while not game.done:
        game.step(RandomMovePlayer().choose(game, rng))
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


# ---- the rated pool ----------------------------------------------------------------------------------------------
def test_ratings_follow_openskill_called_directly():
    pool = OpponentPool("random", ("random", "base"), max_snapshots=2, lagged_window=1)
    model = rating_model()
    learner, rand, base = model.rating(), model.rating(), model.rating()
    for opponent, score in (("random", 1.0), ("base", -1.0), ("random", 0.0), ("base", 1.0)):
        pool.record(opponent, score)
        other = rand if opponent == "random" else base
        ranks = [0, 1] if score > 0 else [1, 0] if score < 0 else [0, 0]
        [[learner], [other]] = model.rate([[learner], [other]], ranks=ranks)
        rand, base = (other, base) if opponent == "random" else (rand, other)
    assert pool.ratings[LEARNER].mu == learner.mu and pool.ratings[LEARNER].sigma == learner.sigma
    assert pool.ratings["random"].mu == rand.mu and pool.ratings["base"].sigma == base.sigma
    assert pool.ratings["random"].games == 2
    pool.record(LEARNER, 1.0)  # a mirror game moves no rating
    assert pool.ratings[LEARNER].mu == learner.mu


def test_sampling_modes():
    pool = OpponentPool("mirror", ("random",), max_snapshots=3, lagged_window=2)
    rng = random.Random(0)
    assert {pool.sample(rng) for _ in range(20)} == {LEARNER}
    for r in range(5):
        pool.add_snapshot(f"round{r:03d}", {"w": torch.full((1,), float(r))})
    assert list(pool.snapshots) == ["round002", "round003", "round004"]  # the oldest left
    pool.sampling = "lagged"
    assert {pool.sample(rng) for _ in range(200)} == {"round003", "round004"}
    pool.sampling = "random"
    counts = Counter(pool.sample(rng) for _ in range(4000))
    assert set(counts) == {"round002", "round003", "round004", "random"}
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts.values())
    for _ in range(6):
        pool.record("random", 1.0)  # the learner pulls away from the random player
    pool.sampling = "match_quality"
    weights = {n: pool.draw_probability(n) for n in pool.candidates()}
    model = rating_model()
    learner = model.rating(mu=pool.ratings[LEARNER].mu, sigma=pool.ratings[LEARNER].sigma)
    for name, weight in weights.items():
        other = model.rating(mu=pool.ratings[name].mu, sigma=pool.ratings[name].sigma)
        assert weight == pytest.approx(model.predict_draw([[learner], [other]]))
    counts = Counter(pool.sample(rng) for _ in range(4000))
    total = sum(weights.values())
    for name, weight in weights.items():
        assert counts[name] / 4000 == pytest.approx(weight / total, abs=0.03)


def test_the_pool_round_trips_its_state_exactly():
    pool = OpponentPool("match_quality", ("random", "base"), max_snapshots=2, lagged_window=1)
    pool.add_snapshot("round000", {"a.lora_B": torch.randn(3)})
    pool.record("round000", -1.0)
    copy = OpponentPool("match_quality", ("random", "base"), max_snapshots=2, lagged_window=1)
    copy.load_state_dict(pool.state_dict())
    assert copy.entries() == pool.entries()
    assert torch.equal(copy.snapshots["round000"]["a.lora_B"], pool.snapshots["round000"]["a.lora_B"])
    a, b = random.Random(3), random.Random(3)
    assert [pool.sample(a) for _ in range(30)] == [copy.sample(b) for _ in range(30)]


# ---- a scripted engine -------------------------------------------------------------------------------------------
LEGAL = re.compile(r"Legal moves: (.*)\n")


class MoveEngine(StubGenerator, SwapsAdapters):
    """Replies to game prompts by rule: `choose(prompt text, who)` with `who` the weights it samples through
    (`policy`, `base` or `snapshot`); records every generate call."""

    def __init__(self, tokenizer, choose) -> None:
        super().__init__()
        self.tokenizer, self.choose = tokenizer, choose
        self.weights = {"m.lora_A.weight": torch.ones(2, 2), "m.lora_B.weight": torch.ones(2, 2)}
        self.who = "policy"
        self.calls: list[tuple[int, str]] = []

    def adapter_weights(self):
        return {k: v.clone() for k, v in self.weights.items()}

    @contextlib.contextmanager
    def sampling_from(self, weights):
        previous = self.who
        self.who = "base" if float(weights["m.lora_B.weight"].abs().sum()) == 0 else "snapshot"
        try:
            yield
        finally:
            self.who = previous

    def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
        self.calls.append((len(prefixes), self.who))
        out = []
        for prefix in prefixes:
            reply = self.choose(self.tokenizer.decode(prefix), self.who)
            ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
            out.append([Completion(ids, [-0.25] * len(ids), finished=True)])
        return out


def lowest_legal(text: str, who: str) -> str:
    """The lowest free cell, without its opening bracket (the reply prefix gives it)."""
    return LEGAL.findall(text)[-1].split(", ")[0][1:]


def always_centre(text: str, who: str) -> str:
    return "4]"


def source() -> GameSeeds:
    return GameSeeds(game="tictactoe")


def test_lockstep_play_batches_each_model_player_and_records_the_learners_prompts(tokenizer):
    engine = MoveEngine(tokenizer, lowest_legal)
    src = source()
    matches = [
        Match(make_game("tictactoe"), 0, RandomMovePlayer(), random.Random(0)),
        Match(make_game("tictactoe"), 1, ModelPlayer("base", adapter_off(engine.adapter_weights())), random.Random(1)),
        Match(make_game("tictactoe"), 0, LEARNER_PLAYER, random.Random(2)),  # mirror: the policy in both seats
    ]
    for m in matches:
        m.game.reset(0)
    original = src.encode

    def encode(game, player):
        return original(tokenizer, game.observation(player))

    steps = []
    play(matches, engine, encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), "[", 30,
         on_step=lambda ms: steps.append(sum(m.done for m in ms)))  # fmt: skip
    # step 1: learner (match 0), mirror seat 0 (match 2) in one call with the policy; base (match 1, seat 0) alone
    assert engine.calls[:2] == [(2, "policy"), (1, "base")]
    assert all(who in ("policy", "base") for _, who in engine.calls)
    assert len(engine.calls) <= 2 * len(steps)  # at most one call per model player and move
    assert steps[-1] == 3 and all(m.done for m in matches)
    # the lowest free cell on both sides: X 0, O 1, X 2, O 3, X 4, O 5, X 6 wins on the 2-4-6 diagonal
    mirror = matches[2]
    assert mirror.game.outcome == (1.0, -1.0)
    assert [t.move for t in mirror.turns] == ["[0]", "[2]", "[4]", "[6]"]  # seat 0's turns only: the learner's
    first = mirror.turns[0]
    empty = make_game("tictactoe")
    empty.reset(0)
    assert first.prompt_ids == original(tokenizer, empty.observation(0))  # exactly what was sampled from
    assert tokenizer.decode(first.prompt_ids).endswith("[")


def test_an_opponents_illegal_move_is_replaced_and_counted(tokenizer):
    engine = MoveEngine(tokenizer, lambda text, who: "4]" if who == "base" else lowest_legal(text, who))
    m = Match(make_game("tictactoe"), 1, ModelPlayer("base", adapter_off(engine.adapter_weights())), random.Random(0))
    m.game.reset(0)
    play([m], engine, lambda g, p: source().encode(tokenizer, g.observation(p)), lambda ids: tokenizer.decode(ids), "[",
         30)  # fmt: skip
    assert m.opponent_illegal >= 1  # base insists on the centre after it is taken
    assert m.game.done and not any(t.illegal for t in m.turns)


def test_a_game_past_max_turns_is_a_draw(tokenizer):
    engine = MoveEngine(tokenizer, lowest_legal)
    m = Match(make_game("tictactoe"), 0, RandomMovePlayer(), random.Random(0))
    m.game.reset(0)
    play([m], engine, lambda g, p: source().encode(tokenizer, g.observation(p)), lambda ids: tokenizer.decode(ids), "[",
         2)  # fmt: skip
    assert m.capped and m.moves == 2 and m.learner_score == 0.0


# ---- a round of the variant --------------------------------------------------------------------------------------
REWARD = {
    "terms": {
        "outcome": {"_target_": "grpo_lightning.rewards.games.GameOutcome"},
        "legal": {"_target_": "grpo_lightning.rewards.games.LegalMove"},
    },
    "group_transforms": {
        "normalize": {"_target_": "grpo_lightning.rewards.transforms.GroupNormalize", "scale": "group"}
    },
}


def prompts(seeds: list[int]) -> list[Prompt]:
    return [Prompt([], "", f"tictactoe seed {s}", s, record=GameSeed("tictactoe", s)) for s in seeds]


def variant(tokenizer, **kwargs) -> SelfPlay:
    v = SelfPlay(**{"games_per_group": 3, "fixed_opponents": ["random"], **kwargs})
    v.bind_data(source(), tokenizer, 512)
    return v


def test_a_round_of_rollouts_scored_as_worked_out_by_hand(tokenizer):
    """The learner always answers [4]: its first move is legal unless the random opponent took the centre first,
    and its second is illegal, so every game is lost. By hand: the first move scores -1 (loss) + 0 (legal), an
    illegal move -1 + -1."""
    v = variant(tokenizer)
    reward = build_reward(REWARD)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    v.begin_round(0)
    rollouts = v.generate_rollouts(MoveEngine(tokenizer, always_centre), prompts([0, 1, 2, 3]), reward, decode)
    groups = {r.group_id for r in rollouts}
    assert groups == {0, 1, 2, 3}
    for r in rollouts:
        assert r.text == "[4]"
        assert r.reward in (-1.0, -2.0)
    illegal = sum(r.reward == -2.0 for r in rollouts)
    assert illegal == 12  # each of the 12 games ends on one illegal move
    assert v.metrics["game/games"] == 12 and v.metrics["game/loss_rate"] == 1.0
    assert v.metrics["game/payoff_mean"] == -1.0  # TicTacToe: the payoff is the outcome
    assert v.metrics["game/illegal_move_rate"] == pytest.approx(illegal / len(rollouts))
    assert v.metrics["pool/size"] == 1.0  # round 0's snapshot
    for g in groups:  # group-normalised: zero mean in each group
        values = [r.advantage for r in rollouts if r.group_id == g]
        assert sum(values) == pytest.approx(0.0, abs=1e-5)


def test_per_move_credit_reaches_each_turn_by_its_distance_from_the_games_end(tokenizer):
    """The same games with `discount` 0.5: a game's illegal last move scores -1 (loss) - 1 (illegal); the legal
    move before it, one learner turn from the end, -1 x 0.5 + 0."""
    v = variant(tokenizer)
    node = {**REWARD, "terms": {**REWARD["terms"], "outcome": {**REWARD["terms"]["outcome"], "discount": 0.5}}}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    v.begin_round(0)
    rollouts = v.generate_rollouts(MoveEngine(tokenizer, always_centre), prompts([0, 1]), build_reward(node), decode)
    for r in rollouts:  # the illegal move is always the game's last
        illegal = r.reward_terms["legal"] == -1.0
        assert r.reward_terms["outcome"] == (-1.0 if illegal else -0.5)
        assert r.reward == (-2.0 if illegal else -0.5)
    assert sum(r.reward == -0.5 for r in rollouts) > 0


def test_a_game_whose_rules_and_state_exceed_data_max_prompt_tokens_is_refused_in_one_line(tokenizer):
    """A limit below a TicTacToe prompt's length: TicTacToe's prompt is its rules and the board alone (nothing to
    leave out), so the round is refused instead of training on the prompt's last tokens, which lose the rules
    (long histories: tests/unit/test_game_prompt_cut.py)."""
    v = SelfPlay(games_per_group=2, fixed_opponents=["random"])
    v.bind_data(source(), tokenizer, 20)
    v.begin_round(0)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"^data\.max_prompt_tokens \(20\) cannot hold a prompt of tictactoe") as err:
        v.generate_rollouts(MoveEngine(tokenizer, always_centre), prompts([0, 1]), build_reward(REWARD), decode)
    assert "\n" not in str(err.value)


def test_resuming_the_pool_plays_the_same_next_round(tokenizer):
    reward = build_reward(REWARD)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    kwargs = {"fixed_opponents": ["random", "base", "perfect"], "opponent_sampling": "match_quality",
              "snapshot_every": 1}  # fmt: skip
    a = variant(tokenizer, **kwargs)
    for r in range(2):
        a.begin_round(r)
        a.generate_rollouts(MoveEngine(tokenizer, lowest_legal), prompts([5, 6]), reward, decode)
    b = variant(tokenizer, **kwargs)
    b.load_state_dict(a.state_dict())
    rounds = []
    for v in (a, b):
        v.begin_round(2)
        engine = MoveEngine(tokenizer, lowest_legal)
        rollouts = v.generate_rollouts(engine, prompts([7, 8]), reward, decode)
        rounds.append(([(r.text, r.reward, r.group_id) for r in rollouts], engine.calls, v.pool.entries()))
    assert rounds[0] == rounds[1]
    with pytest.raises(ValueError, match="no self-play pool"):
        b.load_state_dict({})


def test_progress_is_reported_after_every_move(tokenizer):
    v = variant(tokenizer)
    seen = []
    v.progress_listeners.append(seen.append)
    v.begin_round(0)
    v.generate_rollouts(MoveEngine(tokenizer, lowest_legal), prompts([0]), build_reward(REWARD), tokenizer.decode)
    assert seen and seen[-1].games_finished == seen[-1].games_total == 3
    assert [p.games_finished for p in seen] == sorted(p.games_finished for p in seen)
    assert seen[-1].wins + seen[-1].draws + seen[-1].losses == 3


# ---- rewards -----------------------------------------------------------------------------------------------------
def turn(**kw) -> TurnRecord:
    return TurnRecord(**{"game_id": "tictactoe", "seat": 0, "turn": 0, "move": "[4]", "illegal": False,
                         "outcome": 1.0, "opponent": "random", "learner_turns": 1, "payoff": 1.0, **kw})  # fmt: skip


def test_discounted_outcome_credits_the_last_move_most():
    """discount d: the learner's turn t of T gets the result times d ** (T - 1 - t), by hand."""
    lost = GameOutcome(discount=0.5)
    assert [lost("", "", record=turn(turn=t, learner_turns=3, outcome=-1.0)) for t in range(3)] == [-0.25, -0.5, -1.0]
    won = GameOutcome(win=2.0, discount=0.9)
    assert won("", "", record=turn(turn=0, learner_turns=2)) == pytest.approx(1.8)
    assert GameOutcome(discount=0.5)("", "", record=turn(turn=1, learner_turns=4, outcome=0.0)) == 0.0
    assert [GameOutcome()("", "", record=turn(turn=t, learner_turns=4, outcome=-1.0)) for t in range(4)] == [-1.0] * 4
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="discount"):
            GameOutcome(discount=bad)
    with pytest.raises(ValueError, match="turn 3 of a game in which the learner had 3 turns"):
        lost("", "", record=turn(turn=3, learner_turns=3))


def test_the_payoff_term_scores_the_chips_by_hand():
    """A called bet lost (-2 chips) against a fold won (+1): the payoff, not the outcome; discounted alike."""
    assert GamePayoff()("", "", record=turn(outcome=-1.0, payoff=-2.0)) == -2.0
    assert GamePayoff()("", "", record=turn(outcome=1.0, payoff=1.0)) == 1.0
    assert GamePayoff(discount=0.5)("", "", record=turn(turn=0, learner_turns=2, outcome=-1.0, payoff=-2.0)) == -1.0
    with pytest.raises(ValueError, match="discount must be in"):
        GamePayoff(discount=0)


def test_game_terms():
    assert GameOutcome()("[4]", "", record=turn()) == 1.0
    assert GameOutcome(win=2.0, loss=-3.0)("[4]", "", record=turn(outcome=-1.0)) == -3.0
    assert LegalMove()("", "", record=turn(illegal=True)) == -1.0 and LegalMove()("", "", record=turn()) == 0.0
    assert MoveFormat()("x", "", record=turn(move=None)) == 0.0 and MoveFormat()("[4]", "", record=turn()) == 1.0
    with pytest.raises(TypeError, match="variant=selfplay"):
        GameOutcome()("[4]", "", record=None)
    with pytest.raises(ValueError, match="win must be a finite number"):
        GameOutcome(win=float("nan"))


def test_role_baseline_and_batch_normalize_by_hand():
    role = RoleBaseline(decay=0.5)
    # seat 0: b 0 -> r 1 gives 1, b = 0.5; r 1 gives 0.5, b = 0.75. seat 1 has its own b = 0: r -1 gives -1.
    assert role(1.0, record=turn()) == 1.0
    assert role(-1.0, record=turn(seat=1)) == -1.0
    assert role(1.0, record=turn()) == 0.5
    assert role.state_dict() == {"baselines": {"tictactoe/seat0": 0.75, "tictactoe/seat1": -0.5}}
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    std = float(torch.tensor([1.0, 2.0, 3.0, 6.0]).std())  # 2.160...
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (std + 1e-4)
    assert torch.allclose(BatchNormalize()(rewards, torch.tensor([0, 0, 1, 1])), expected)
    assert torch.equal(BatchNormalize()(torch.ones(3), torch.zeros(3, dtype=torch.long)), torch.zeros(3))


# ---- evaluation --------------------------------------------------------------------------------------------------
def random_cell(text: str, who: str) -> str:
    cells = LEGAL.findall(text)[-1].split(", ")
    return cells[int(torch.randint(len(cells), ()))][1:]


def game_evaluator(dataset: GameSeeds, seeds: int, opponents: list[str], engine, tokenizer):
    """A GameEvaluator of `seeds` test seeds of `dataset` against `opponents`, started on a stand-in trainer whose
    logger keeps what it logs (returned with it, with that list)."""
    logged: list[dict] = []
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, ckpt_path=None, lightning_module=None,
                              loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))])  # fmt: skip
    evaluator = GameEvaluator(dataset.test_split(num_problems=seeds), opponents=opponents, num_problems=seeds,
                              at_start=False, generator=engine, tokenizer=tokenizer)  # fmt: skip
    evaluator.at_fit_start(trainer)
    return evaluator, trainer, logged


def test_evaluation_is_the_same_for_the_same_weights_and_leaves_the_rng_alone(tokenizer):
    evaluator, trainer, logged = game_evaluator(source(), 6, ["random", "base"], MoveEngine(tokenizer, random_cell),
                                                tokenizer)  # fmt: skip
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = evaluator.evaluate(trainer)
    assert torch.equal(torch.get_rng_state(), state)
    second = evaluator.evaluate(trainer)
    for key in first:
        if not key.startswith("time/"):
            assert first[key] == second[key], key
    assert first["eval/games"] == 24.0  # 6 seeds x 2 seats x 2 opponents
    for name in ("random", "base"):
        for who in (name, f"{name}_first", f"{name}_second"):  # both seats, then each seat's 6 games
            rates = [first[f"eval/{k}_rate_vs_{who}"] for k in ("win", "draw", "loss")]
            assert sum(rates) == pytest.approx(1.0)
            for k, r in zip(("win", "draw", "loss"), rates, strict=True):
                low, high = (first[f"eval/{k}_rate_vs_{who}_ci95_{end}"] for end in ("low", "high"))
                assert (low, high) == pytest.approx(wilson_interval(round(r * (12 if who == name else 6)),
                                                                    12 if who == name else 6))  # fmt: skip
                assert low <= r <= high
        for k in ("win", "draw", "loss"):  # equal games a seat: the overall rate is the seats' mean
            seats = (first[f"eval/{k}_rate_vs_{name}_first"], first[f"eval/{k}_rate_vs_{name}_second"])
            assert first[f"eval/{k}_rate_vs_{name}"] == pytest.approx(sum(seats) / 2)
    assert logged and logged[0] is not None


def bet_or_call(text: str, who: str) -> str:
    """Kuhn Poker: bet when you may, else call (without the opening bracket the reply prefix gives)."""
    return "bet]" if "[bet]" in text.rsplit("Legal moves:", 1)[-1] else "call]"


class BetOrCall(ScriptedPlayer):
    name = "bet_or_call"

    def move_distribution(self, game):
        return {"[bet]" if "[bet]" in game.legal_moves() else "[call]": 1.0}


def test_a_kuhn_evaluation_reports_the_chips_won_around_their_exact_expectation(tokenizer):
    """The learner bets or calls every hand against the random player over 600 seeds (every deal 100 times) from
    both seats: the mean chips it won, per seat and overall, hold the exact expectation (games/exact.py; +0.5 from
    the first seat, +0.25 from the second) inside their 95% intervals. TicTacToe reports no payoff."""
    kuhn = GameSeeds(game="kuhn_poker", eval_seed=1200)
    evaluator, trainer, _ = game_evaluator(kuhn, 600, ["random"], MoveEngine(tokenizer, bet_or_call), tokenizer)
    metrics = evaluator.evaluate(trainer)
    first, second, both = both_seats(KuhnPoker, BetOrCall(), RandomMovePlayer(), seeds=range(6))
    assert (first.payoff, second.payoff) == (pytest.approx(0.5), pytest.approx(0.25))
    for who, exact in (("random", both.payoff), ("random_first", first.payoff), ("random_second", second.payoff)):
        low, high = metrics[f"eval/payoff_vs_{who}_ci95_low"], metrics[f"eval/payoff_vs_{who}_ci95_high"]
        assert low < exact < high and low < metrics[f"eval/payoff_vs_{who}"] < high and high - low < 0.3
    assert metrics["eval/illegal_move_rate"] == 0.0
    tictactoe, trainer, _ = game_evaluator(source(), 2, ["random"], MoveEngine(tokenizer, lowest_legal), tokenizer)
    assert not any(key.startswith("eval/payoff") for key in tictactoe.evaluate(trainer))


# ---- the HF engine's adapter swaps -------------------------------------------------------------------------------
def test_sampling_from_swaps_and_restores_bit_for_bit(tiny_model, tokenizer):
    policy = lora_policy_with_random_adapters(tiny_model)
    engine = HFGenerator(policy, tokenizer, max_new_tokens=6)
    own = engine.adapter_weights()
    prefix = tokenizer("Tic tac toe?", add_special_tokens=False)["input_ids"]

    def greedy():
        return engine.generate([prefix], 1, greedy=True)[0][0]

    with engine.sampling_from(adapter_off(own)):
        as_base = greedy()
    with torch.no_grad(), policy.disable_adapter():  # peft's own switch, without our merged copies
        engine.generation_settings = type(engine.generation_settings)(merge_lora=False)
        reference = greedy()
    assert as_base.token_ids == reference.token_ids
    assert as_base.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    after = engine.adapter_weights()
    assert all(torch.equal(own[k], after[k]) for k in own)
    with pytest.raises(ValueError, match="does not match"), engine.sampling_from({"nope": torch.zeros(1)}):
        pass


# ---- docs/selfplay.md's example game -----------------------------------------------------------------------------
def test_the_docs_example_game_plays_by_its_rules():
    from pathlib import Path

    from grpo_lightning.games.registry import BUILTIN_GAMES, check_game_id

    text = (Path(__file__).resolve().parents[2] / "docs" / "selfplay.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(block, "docs/selfplay.md", "exec"), namespace)  # noqa: S102 - the page's own example
        assert check_game_id("take_one_or_two") is None
        game = make_game("take_one_or_two")
        game.reset(0)
        for move in ("[1]", "[2]", "[1]", "[2]"):  # 7 -> 6 -> 4 -> 3 -> 1
            assert not game.step(f"I take {move}").illegal
        assert game.legal_moves() == ["[1]"]
        result = game.step("[1]")  # seat 0 takes the last stone
        assert result.done and result.outcome == (1.0, -1.0)
        game.reset(0)
        result = game.step("[3]")
        assert result.illegal and game.outcome == (-1.0, 1.0)
    finally:
        BUILTIN_GAMES.pop("take_one_or_two", None)


class EndOrPass:
    """A game the first mover can end at once ([end]: seat 0 wins) or hand over ([pass]); then any move by seat 1
    ends it in a draw. A learner in seat 1 facing a random first mover may not get to move in a game."""

    def __init__(self) -> None:
        from grpo_lightning.games.base import StepResult

        self.StepResult, self.game_id = StepResult, "end_or_pass"

    def reset(self, seed):
        self.to_move, self._outcome = 0, None

    current_player = property(lambda self: self.to_move)
    done = property(lambda self: self._outcome is not None)
    outcome = property(lambda self: self._outcome)
    payoff = outcome

    def legal_moves(self):
        return ["[end]", "[pass]"] if self.to_move == 0 else ["[draw]"]

    def observation(self, player):
        return "Legal moves: " + ", ".join(self.legal_moves()) + "\n"

    def step(self, reply):
        if self.to_move == 0 and "[end]" in reply:
            self._outcome = (1.0, -1.0)
        elif self.to_move == 0:
            self.to_move = 1
            return self.StepResult(illegal=False, done=False)
        else:
            self._outcome = (0.0, 0.0)
        return self.StepResult(illegal=False, done=True, outcome=self._outcome)


def test_a_group_whose_learner_never_moved_gets_more_games_of_the_same_seat_and_opponent(tokenizer, monkeypatch):
    import grpo_lightning.variants.selfplay as selfplay

    monkeypatch.setattr(selfplay, "make_game", lambda game_id: EndOrPass())
    v = variant(tokenizer, games_per_group=2)
    dealt = []
    original = v.match
    monkeypatch.setattr(v, "match", lambda *a: dealt.append(original(*a)) or dealt[-1])
    prompts_ = [Prompt([], "", f"seed {s}", s, record=GameSeed("end_or_pass", s)) for s in range(40)]
    v.begin_round(0)
    rollouts = v.generate_rollouts(MoveEngine(tokenizer, lambda text, who: "draw]"), prompts_, build_reward(REWARD),
                                   tokenizer.decode)  # fmt: skip
    assert {r.group_id for r in rollouts} == set(range(40))  # every group has a move of the learner
    extra = v.metrics["game/extra_games"]
    assert extra > 0 and len(dealt) == 80 + extra  # about 1 in 8 games: seat 1, and the opponent ended it
    for g in range(40):
        group = [m for m in dealt if m.group_id == g]
        assert len({(m.learner_seat, m.opponent.name) for m in group}) == 1  # the same seat and opponent
