"""Self-play over the legal moves (`variant.move_policy=legal_moves`, docs/selfplay.md "Moves over the legal moves"):
the policy's probability of a move is that of its tokens and EOS, renormalised over the position's legal moves;
moves are drawn from it, and the training step's loss, entropy, KL and magnet pull are computed over moves.

Truths: a plain float64 forward of the tiny model, one (prompt, move) row at a time, for the log-probs; the same
float64 copy differentiated through a loss written out here from its definition (the clipped surrogate of the
move's ratio, the exact KL to the reference and to the magnet, the exact entropy) for the gradient; a stand-in
module with chosen probabilities for the draws (their frequencies, and the match's own seeded RNG).
"""

from __future__ import annotations

import copy
import math
import random
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.data.games import GameSeed, GameSeeds
from grpo_lightning.games.kuhn_poker import INFOSETS, KuhnPoker
from grpo_lightning.games.policy_moves import LegalMoveSampler, draw
from grpo_lightning.games.registry import make_game
from grpo_lightning.rewards.pipeline import build_reward
from grpo_lightning.training.module import GRPOModule, LRSchedule
from grpo_lightning.types import MoveChoice, Prompt, Rollout
from grpo_lightning.variants.selfplay import SelfPlay
from tests.helpers import lora_policy_with_random_adapters
from tests.unit.test_kuhn_exploitability_eval import WeightsModule, infoset_of
from tests.unit.test_selfplay import MoveEngine

TEMPERATURE = 0.7


def positions() -> list:
    """Three TicTacToe positions with 7, 5 and 3 legal moves."""
    out = []
    for moves in (["[4]", "[0]"], ["[4]", "[0]", "[8]", "[2]"], ["[4]", "[0]", "[8]", "[2]", "[6]", "[3]"]):
        game = make_game("tictactoe")
        game.reset(0)
        for move in moves:
            game.step(move)
        out.append(game)
    return out


def alternatives_by_hand(tokenizer, game) -> list[list[int]]:
    """Each legal move's text after the reply prefix '[' (`4]`), tokenised alone, then EOS."""
    return [
        tokenizer(move[1:], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for move in game.legal_moves()
    ]


def plain_move_logq(model, prompt: list[int], alternatives: list[list[int]]) -> torch.Tensor:  # [K]
    """log pi over the alternatives: each row's tokens' log_softmax(logits / T) summed, one forward a row, then
    normalised over the rows (differentiable through `model`)."""
    sums = []
    for ids in alternatives:
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]  # [P + C, V]
        steps = torch.log_softmax(logits[len(prompt) - 1 : -1] / TEMPERATURE, dim=-1)  # [C, V]
        sums.append(steps.gather(1, torch.tensor(ids)[:, None]).sum())
    sums = torch.stack(sums)
    return sums - torch.logsumexp(sums, dim=0)


def make_module(policy, **loss) -> GRPOModule:
    module = GRPOModule(policy, None, GRPOLoss(**loss), optimizer=None, schedule=LRSchedule(), total_steps=1,
                        temperature=TEMPERATURE)  # fmt: skip
    module._trainer = SimpleNamespace(accumulate_grad_batches=1, world_size=1)  # what the step reads of it
    module.log_dict = lambda *args, **kwargs: None
    return module


def rollouts_of(tokenizer, chosen: list[int], advantages: list[float], old: list[float], magnet: bool) -> list:
    source = GameSeeds(game="tictactoe")
    out = []
    for game, k, adv, old_logq in zip(positions(), chosen, advantages, old, strict=True):
        prompt = source.encode(tokenizer, game.observation(game.current_player))
        alts = tuple(tuple(a) for a in alternatives_by_hand(tokenizer, game))
        uniform = tuple([-math.log(len(alts))] * len(alts)) if magnet else None
        choice = MoveChoice(alts, k, old_logq, uniform)
        out.append(Rollout(prompt, list(alts[k]), [0.0] * len(alts[k]), 0.0, 0, False, advantage=adv,
                           move_choice=choice))  # fmt: skip
    return out


def test_move_logprobs_are_the_plain_forward_s_renormalised_over_the_legal_moves(tiny_model, tokenizer):
    policy = lora_policy_with_random_adapters(tiny_model).train()
    module = make_module(policy)
    rollouts = rollouts_of(tokenizer, [0, 3, 2], [1.0, -1.0, 0.5], [0.0, 0.0, 0.0], magnet=False)
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
    logq = module.move_logprobs(policy, batch.moves)[0].detach()  # [B, K]
    exact = copy.deepcopy(policy).double().eval()
    with torch.no_grad():
        for b, r in enumerate(rollouts):
            truth = plain_move_logq(exact, r.prompt_ids, [list(a) for a in r.move_choice.alternatives])
            k = len(truth)
            assert logq[b, :k].double() == pytest.approx(truth, abs=1e-5)
            assert torch.isinf(logq[b, k:]).all()
    # the sampler scores the same distribution, and its alternatives are the ones written out by hand
    sampler = LegalMoveSampler(module, tokenizer, "[")
    game = positions()[1]
    assert [list(a) for a in sampler.alternatives(game.legal_moves())] == alternatives_by_hand(tokenizer, game)
    [found] = sampler.log_distributions([rollouts[1].prompt_ids], [rollouts[1].move_choice.alternatives])
    assert found == pytest.approx(logq[1, :5].double(), abs=1e-5)


@pytest.mark.parametrize(
    "loss",
    [{"beta": 0.1}, {"beta": 0.05, "magnet_coef": 0.3, "entropy_coef": 0.05, "loss_type": "dr_grpo"}],
    ids=["surrogate_kl", "all_dr_grpo"],
)
def test_the_step_s_gradient_is_that_of_the_move_loss_written_out(tiny_model, tokenizer, loss):
    """The gradient of the training step over moves against the float64 autograd of the loss written out: for each
    position, -min(r A, clip(r, 1 - 0.2, 1 + 0.2) A) with r the played move's probability over the one it was
    drawn with, beta x sum_k pi_k (log pi_k - log pi_ref_k) (the reference: the adapter off), magnet_coef x the same
    against the uniform magnet, averaged over positions (one unit each, whatever the loss type; dr_grpo's constant
    is the move), less entropy_coef x the mean entropy. Position 3 was drawn with a far smaller probability (its
    ratio is clipped: no policy gradient from it)."""
    policy = lora_policy_with_random_adapters(tiny_model).train()
    exact = copy.deepcopy(policy).double().eval()
    chosen, advantages = [0, 3, 2], [1.0, -0.5, 0.8]
    with torch.no_grad():
        current = [
            float(plain_move_logq(exact, r.prompt_ids, [list(a) for a in r.move_choice.alternatives])[k])
            for r, k in zip(rollouts_of(tokenizer, chosen, advantages, [0.0] * 3, False), chosen, strict=True)
        ]
    old = [current[0], current[1] - 0.01, current[2] - 2.0]  # ratios 1, about 1.01, about e^2 (clipped)
    rollouts = rollouts_of(tokenizer, chosen, advantages, old, magnet=True)
    module = make_module(policy, **loss)
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
    batch.num_tokens_in_step = batch.trained_units
    policy.zero_grad()
    module.move_training_step(batch).backward()
    found = {n: p.grad.double() for n, p in policy.named_parameters() if p.requires_grad}

    beta, magnet, entropy = loss.get("beta", 0.0), loss.get("magnet_coef", 0.0), loss.get("entropy_coef", 0.0)
    total = torch.zeros((), dtype=torch.float64)
    for r, k, adv, old_logq in zip(rollouts, chosen, advantages, old, strict=True):
        alts = [list(a) for a in r.move_choice.alternatives]
        logq = plain_move_logq(exact, r.prompt_ids, alts)  # [K]
        ratio = torch.exp(logq[k] - old_logq)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        pi = logq.exp()
        term = -surrogate - entropy * -(pi * logq).sum()
        term = term + magnet * (pi * (logq + math.log(len(alts)))).sum()
        if beta:
            with torch.no_grad(), exact.disable_adapter():
                ref = plain_move_logq(exact, r.prompt_ids, alts)
            term = term + beta * (pi * (logq - ref)).sum()
        total = total + term / len(rollouts)
    exact.zero_grad()
    total.backward()
    truth = {n: p.grad for n, p in exact.named_parameters() if p.requires_grad}
    scale = max(float(g.abs().max()) for g in truth.values())  # float32 rounding is relative to the largest
    assert scale > 1e-4
    for name, grad in truth.items():
        torch.testing.assert_close(found[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


class FixedMoves(WeightsModule):
    """A stand-in module whose Kuhn Poker move weights are chosen, its EOS ignored (only the move text counts)."""

    def completion_logprobs(self, model, batch):
        self.modes_seen.append(model.training)
        logp = torch.zeros(batch.completion_ids.shape, dtype=torch.float64)  # [B, C]
        for row in range(len(batch)):
            mask = batch.attention_mask[row].bool()
            prompt = self.tokenizer.decode(batch.input_ids[row, : batch.prompt_len][mask[: batch.prompt_len]])
            real = batch.sequence_mask[row].bool()
            text = self.tokenizer.decode(batch.completion_ids[row][real], skip_special_tokens=True).rstrip("]")
            logp[row, 0] = math.log(self.weights[infoset_of(prompt)][text])
        return logp


def test_draws_follow_the_distribution_from_each_match_s_own_rng(tokenizer):
    """Moves drawn 3,000 times at a position where the stand-in module bets with probability 0.2: the share of bets
    within 0.03 of it; the same seeds draw the same moves; every pick is a legal move with its tokens, EOS last,
    and its log-prob over the legal moves."""
    weights = {key: ({"call": 1.0, "fold": 1.0} if h.endswith("bet") else {"bet": 0.2, "check": 0.8})
               for key in INFOSETS for h in [key[1]]}  # fmt: skip
    sampler = LegalMoveSampler(FixedMoves(tokenizer, weights), tokenizer, "[")
    game = KuhnPoker()
    game.reset(0)
    prompt = GameSeeds(game="kuhn_poker").encode(tokenizer, game.observation(0))
    picks = sampler.sample([prompt] * 3000, [game.legal_moves()] * 3000, [random.Random(i) for i in range(3000)])
    bets = sum(p.move == "[bet]" for p in picks)
    assert abs(bets / 3000 - 0.2) < 0.03
    again = sampler.sample([prompt] * 50, [game.legal_moves()] * 50, [random.Random(i) for i in range(50)])
    assert [p.move for p in again] == [p.move for p in picks[:50]]
    for pick in picks[:10]:
        alts = pick.choice.alternatives
        assert pick.move in game.legal_moves() and alts[pick.choice.chosen] == tuple(pick.completion.token_ids)
        assert pick.completion.token_ids[-1] == tokenizer.eos_token_id and pick.completion.finished
        assert pick.choice.logprob == pytest.approx(math.log(0.2 if pick.move == "[bet]" else 0.8), abs=1e-12)
    assert [draw([0.5, 0.5], u) for u in (0.0, 0.49, 0.5, 0.999)] == [0, 0, 1, 1]


def test_a_round_over_moves_never_plays_an_illegal_move_and_carries_the_magnet(tokenizer):
    """A Kuhn Poker round over the legal moves against the random player: every learner turn is a legal move drawn
    by the stand-in's probabilities (the engine's text is never asked for), and each rollout carries its legal
    moves, the played one, and the uniform magnet's log-probs."""
    weights = {key: {"call": 0.5, "fold": 0.5} if key[1].endswith("bet") else {"bet": 0.3, "check": 0.7}
               for key in INFOSETS}  # fmt: skip
    module = FixedMoves(tokenizer, weights)
    v = SelfPlay(games_per_group=2, fixed_opponents=["random"], max_turns=3, move_policy="legal_moves",
                 magnet="uniform")  # fmt: skip
    v.bind_data(GameSeeds(game="kuhn_poker"), tokenizer, 512)
    v.bind_module(module)
    v.begin_round(0)
    engine = MoveEngine(tokenizer, lambda text, who: "nonsense")  # would be illegal, were it asked
    prompts = [Prompt([], "", f"kuhn seed {s}", s, record=GameSeed("kuhn_poker", s)) for s in range(6)]
    reward = build_reward({"terms": {"payoff": {"_target_": "grpo_lightning.rewards.games.GamePayoff"}}})
    rollouts = v.generate_rollouts(engine, prompts, reward, lambda ids: tokenizer.decode(ids))
    assert not engine.calls and v.metrics["game/illegal_move_rate"] == 0.0
    for r in rollouts:
        choice = r.move_choice
        assert len(choice.alternatives) == 2 and list(choice.alternatives[choice.chosen]) == r.completion_ids
        assert choice.magnet_logprobs == (pytest.approx(-math.log(2)),) * 2
        assert r.text in ("[bet]", "[check]", "[call]", "[fold]")
    batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
    assert batch.trained_units == len(rollouts) and batch.moves.rows.input_ids.shape[0] == 2 * len(rollouts)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["variant.magnet=uniform", "loss.magnet_coef=0.2"], "variant.magnet=uniform pulls"),
        (["variant.move_policy=legal_moves", "variant.magnet=snapshot"], "set loss.magnet_coef > 0"),
        (["variant.move_policy=legal_moves", "loss.magnet_coef=0.2"], "loss.magnet_coef=0.2 weighs"),
        (["variant.move_policy=legal_moves", "eval.move_policy=text"], "eval.move_policy=text but"),
        (["variant.move_policy=legal_moves", "probe=entropy"], "probe=entropy reads the token forward"),
    ],
)
def test_settings_that_do_not_go_together_are_named(tmp_path, overrides, words):
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg

    with pytest.raises(ValueError) as err:
        build_run(make_cfg(tmp_path, ["experiment=selfplay_kuhn", "model=tiny", *overrides]))
    assert words in str(err.value)


def test_a_magnet_weight_without_self_play_is_named(tmp_path):
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg

    with pytest.raises(ValueError, match="loss.magnet_coef pulls moves"):
        build_run(make_cfg(tmp_path, ["model=tiny", "loss.magnet_coef=0.1"]))


@pytest.mark.slow
@pytest.mark.parametrize(("refresh", "moved"), [(1, False), (50, True)])
def test_a_run_over_moves_with_a_snapshot_magnet(tmp_path, refresh, moved):
    """The Kuhn Poker recipe over the legal moves on the tiny model, a snapshot magnet, 3 rounds of one optimizer
    step. The round's magnet is the policy itself when it was refreshed at that round's start, so the move KL to it,
    read before the round's step, is 0; refreshed at round 0 only, the policy has moved from it by rounds 1 and 2.
    No move is illegal, in training or in the evaluation."""
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg
    from tests.test_ddp import scalars

    run_dir = tmp_path / "run"
    overrides = ["experiment=selfplay_kuhn", "model=tiny", "trainer.max_epochs=3", "trainer.enable_progress_bar=false",
                 "variant.games_per_group=2", "data.prompts_per_round=2", "eval.num_problems=6",
                 "variant.move_policy=legal_moves", "variant.magnet=snapshot", f"variant.magnet_refresh={refresh}",
                 "loss.magnet_coef=0.2", "optim.optimizer.lr=0.05"]  # fmt: skip
    metrics = build_run(make_cfg(run_dir, overrides)).fit()
    kl = scalars(run_dir, "train/magnet_kl")
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-6)
    if moved:
        assert min(kl[1:]) > 1e-6
    else:
        assert kl == pytest.approx([0.0] * 3, abs=1e-6)
    assert scalars(run_dir, "game/illegal_move_rate") == [0.0] * 3
    assert metrics["eval/illegal_move_rate"] == 0.0
    assert all(0.0 < h <= math.log(2) + 1e-6 for h in scalars(run_dir, "train/move_entropy"))


def test_the_snapshot_magnet_is_saved_and_restored_with_the_pool():
    v = SelfPlay(move_policy="legal_moves", magnet="snapshot")
    v.magnet_weights = {"m.lora_B.weight": torch.randn(2, 2)}
    state = v.state_dict()
    w = SelfPlay(move_policy="legal_moves", magnet="snapshot")
    w.load_state_dict(state)
    assert torch.equal(w.magnet_weights["m.lora_B.weight"], v.magnet_weights["m.lora_B.weight"])
    empty = SelfPlay().state_dict()
    assert empty["magnet"] is None and SelfPlay().load_state_dict(empty) is None


def test_position_credit_adds_each_move_s_reward_against_its_position_s_other_moves():
    """`variant.position_weight` 0.5, by hand: three groups of two turns; position A met three times (rewards 1,
    -1, 1: mean 1/3, unbiased std sqrt(4/3)), B twice (-1, 1: mean 0, std sqrt(2)), C once (no credit of its own).
    Each turn's advantage is its group's (reward minus the group mean over the group std) plus 0.5 x that."""
    reward = build_reward({"terms": {"payoff": {"_target_": "grpo_lightning.rewards.games.GamePayoff"}},
                           "group_transforms": {"normalize": {"_target_": "grpo_lightning.rewards.transforms."
                                                              "GroupNormalize", "scale": "group"}}})  # fmt: skip
    a, b, c = [1, 2, 3], [1, 2, 4], [5]
    turns = [(a, 1.0, 0), (b, -1.0, 0), (a, -1.0, 1), (c, 0.0, 1), (a, 1.0, 2), (b, 1.0, 2)]
    rollouts = [Rollout(p, [7], [0.0], r, g, False) for p, r, g in turns]
    v = SelfPlay(position_weight=0.5)
    v.begin_round(0)
    v.assign_advantages(rollouts, reward)
    eps, root2, a_std = 1e-4, math.sqrt(2), math.sqrt(4 / 3)
    half = root2 / 2  # group 1's rewards (-1, 0): mean -1/2, std sqrt(1/2); group 2's (1, 1) all alike: 0
    group = [1 / (root2 + eps), -1 / (root2 + eps), -0.5 / (half + eps), 0.5 / (half + eps), 0.0, 0.0]
    position = [(2 / 3) / (a_std + eps), -1 / (root2 + eps), (-4 / 3) / (a_std + eps), 0.0, (2 / 3) / (a_std + eps),
                1 / (root2 + eps)]  # fmt: skip
    expected = [g + 0.5 * p for g, p in zip(group, position, strict=True)]
    assert [r.advantage for r in rollouts] == pytest.approx(expected, abs=1e-5)
    assert v.metrics["game/repeated_position_frac"] == pytest.approx(5 / 6)
    off = [Rollout(p, [7], [0.0], r, g, False) for p, r, g in turns]
    SelfPlay().assign_advantages(off, reward)
    assert [r.advantage for r in off] == pytest.approx(group, abs=1e-5)
