"""The policy's exact results in TicTacToe (`eval.exact_opponents`, games/policy_moves.py): its move
distribution read at every position it can reach, the games' probabilities summed over the whole tree.

Truths: every game enumerated one by one, its probability the product of its moves' (the policy's computed here
from the same weights, the opponent's from its rule), no position shared, from a mid-game board small enough for
that; and a policy that weighs every legal move alike, which is the random player, whose results against the
scripted players `games/exact.py` computes without the policy (tests/unit/test_games.py holds those against
sampled play).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from grpo_lightning.data.games import GameSeeds
from grpo_lightning.games.exact import both_seats
from grpo_lightning.games.play import RandomMovePlayer, TacticPlayer
from grpo_lightning.games.policy_moves import exact_results, learner_positions, strategy_table
from grpo_lightning.games.tictactoe import TicTacToe
from grpo_lightning.training.game_evaluation import GameEvaluator
from tests.unit.test_kuhn_exploitability_eval import CheckOrCall

OPENING = ("[4]", "[0]", "[8]")
"""Three moves in: X at 4 and 8, O at 0, O to move; 6 free cells (at most 6! games)."""


class Opened(TicTacToe):
    """TicTacToe that starts after `OPENING`."""

    def reset(self, seed: int) -> None:
        super().reset(seed)
        for move in OPENING:
            self.step(move)


def weight(board: str, move: str) -> float:
    """An uneven, position-dependent weight of each legal move (unnormalised)."""
    cell = int(move[1])
    return 1.0 + cell + 3.0 * board.count("X") * (cell % 2)


class WeightModule:
    """A stand-in training module: each (prompt, move) row's log-prob is log weight(board, move), spread over the
    move's tokens; the board is read back from the prompt (`encode` puts it there)."""

    def __init__(self, tokenizer, uniform: bool = False) -> None:
        self.tokenizer, self.uniform = tokenizer, uniform
        self.policy = nn.Linear(1, 1)
        self.device = torch.device("cpu")
        self.rows = 0

    def completion_logprobs(self, model, batch):
        logp = torch.zeros(batch.completion_ids.shape, dtype=torch.float64)  # [B, C]
        for row in range(len(batch)):
            real = batch.sequence_mask[row].bool()  # [C]
            value = 0.0
            if not self.uniform:
                mask = batch.attention_mask[row, : batch.prompt_len].bool()
                board = self.tokenizer.decode(batch.input_ids[row, : batch.prompt_len][mask]).split("|")[-1]
                move = "[" + self.tokenizer.decode(batch.completion_ids[row][real])
                value = math.log(weight(board, move))
            logp[row, real] = value / int(real.sum())
        self.rows += len(batch)
        return logp


def encode_board(tokenizer):
    """A prompt that ends with the board, so the stand-in module can read the position."""
    return lambda game, player: tokenizer(f"position|{game.board}", add_special_tokens=False)["input_ids"]


def brute_force(game: TicTacToe, seat: int, opponent) -> tuple[float, float, float]:
    """(win, draw, loss) of the policy in `seat`: every game from `game` one by one, nothing memoised."""
    if game.done:
        result = game.outcome[seat]
        return float(result > 0), float(result == 0), float(result < 0)
    if game.current_player == seat:
        moves = game.legal_moves()
        total = sum(weight(game.board, m) for m in moves)
        dist = {m: weight(game.board, m) / total for m in moves}
    else:
        dist = opponent.move_distribution(game)
    out = [0.0, 0.0, 0.0]
    for move, p in dist.items():
        after = copy.deepcopy(game)
        after.step(move)
        for i, v in enumerate(brute_force(after, seat, opponent)):
            out[i] += p * v
    return tuple(out)


@pytest.mark.parametrize("opponent", [RandomMovePlayer(), TacticPlayer()], ids=["random", "tactic"])
def test_exact_results_equal_every_game_enumerated(tokenizer, opponent):
    module = WeightModule(tokenizer)
    found = exact_results(module, encode_board(tokenizer), Opened, {"o": opponent}, tokenizer, "[", rows_per_forward=7)
    root = Opened()
    root.reset(0)
    for seat in (0, 1):
        value = found["o"][seat]
        assert (value.win, value.draw, value.loss) == pytest.approx(brute_force(root, seat, opponent), abs=1e-12)
        assert value.win + value.draw + value.loss == pytest.approx(1.0, abs=1e-12)


def test_each_reachable_position_is_read_once_and_batches_change_nothing(tokenizer):
    root = Opened()
    root.reset(0)
    tactic = learner_positions(root, 1, TacticPlayer())
    every = learner_positions(root, 1, RandomMovePlayer())
    assert len({g.board for g in every}) == len(every)  # each once
    assert {g.board for g in tactic} <= {g.board for g in every} and all(g.current_player == 1 for g in every)
    assert root.board == "O...X...X"  # the root is left as it was
    encode = encode_board(tokenizer)
    whole = strategy_table(WeightModule(tokenizer), encode, every, tokenizer, "[", rows_per_forward=10_000)
    split = strategy_table(WeightModule(tokenizer), encode, every, tokenizer, "[", rows_per_forward=3)
    assert whole.keys() == split.keys() and all(whole[k] == pytest.approx(split[k], abs=1e-15) for k in whole)


def test_a_policy_that_weighs_every_move_alike_is_worth_what_the_random_player_is(tokenizer):
    """Through the game evaluator, from the empty board: the uniform policy's exact results against `random` and
    `tactic` are the random player's, computed by games/exact.py with no policy involved."""
    logged: list[dict] = []
    module = WeightModule(tokenizer, uniform=True)
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, ckpt_path=None, lightning_module=module,
                              loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))])  # fmt: skip
    dataset = GameSeeds(game="tictactoe", eval_seed=1200).test_split(num_problems=1)
    evaluator = GameEvaluator(dataset, opponents=["random"], exact_opponents=["random", "tactic"], num_problems=1,
                              at_start=False, generator=CheckOrCall(tokenizer), tokenizer=tokenizer)  # fmt: skip
    evaluator.at_fit_start(trainer)
    metrics = evaluator.evaluate(trainer)
    for name, player in (("random", RandomMovePlayer()), ("tactic", TacticPlayer())):
        first, second, mean = both_seats(TicTacToe, RandomMovePlayer(), player)
        for suffix, value in (("", mean), ("_first", first), ("_second", second)):
            for what in ("win", "draw", "loss"):
                key = f"eval/exact_{what}_rate_vs_{name}{suffix}"
                assert metrics[key] == pytest.approx(getattr(value, what), abs=1e-12), key
    assert module.rows == 8631 + 7536  # every legal move of the 4,520 positions the policy moves in, once
    assert metrics["eval/exact_win_rate_vs_random_first"] == pytest.approx(0.585, abs=1e-3)  # X's known value


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["eval.exact_opponents=[base]"], "eval.exact_opponents must name only random, perfect, tactic ('base'"),
        (["data.dataset.game=kuhn_poker", "eval.exact_opponents=[random]", "eval.opponents=[random]",
          "variant.fixed_opponents=[random]"],
         "eval.exact_opponents: exact results read the policy at every position it can reach"),
    ],
)  # fmt: skip
def test_exact_opponents_the_game_cannot_take_are_named(tmp_path, overrides, words):
    from grpo_lightning.app.validation import validate
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, ["experiment=selfplay_tictactoe", *overrides])
    with pytest.raises(ValueError) as err:
        validate(cfg, platform=False)
    assert words in str(err.value) and "\n" not in str(err.value)
