"""The policy's moves read from its probabilities rather than from play: at each position, the probability of each
legal move's text, normalised over the legal moves (docs/selfplay.md, "Exploitability (Kuhn Poker)", "Moves over
the legal moves").

A move's probability is that of its text as the completion of the turn's prompt, the prompt the policy plays from
(`TurnPrompts`: chat template, observation, reply prefix): the product of its tokens' probabilities at the
training temperature, the distribution the policy samples from (without `generator.top_p` / `top_k`). The text is
the move less the reply prefix the prompt already ends with (`[check]` after `[` is `check]`), tokenised alone;
with a terminator (`variant.move_policy=legal_moves`) the end of the reply follows it. Normalising over the legal
moves gives the strategy of a policy that plays a legal move: what the game reads from a reply that starts with a
move's text. Every move of every position is one row of a batched forward of the training module
(`GRPOModule.completion_logprobs`), under no gradient, in eval mode, under a forked RNG: training's state is left
as it was.

Read: a game's whole strategy (`policy_strategy`: Kuhn Poker's exploitability and its best-response opponent), the
policy's exact results against scripted players (`exact_results`: TicTacToe). Drawn: `LegalMoveSampler`, the
moves self-play's model players make over the legal moves.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.exact import Expected, after_move, expected_results, position_key
from grpo_lightning.games.play import MovePick, ScriptedPlayer
from grpo_lightning.types import Completion, MoveChoice, Rollout, RolloutBatch


@runtime_checkable
class ScoresCompletions(Protocol):
    """What reading a strategy needs of the training module (`GRPOModule`): its policy, its device, and the
    log-probs of completion tokens at the sampling temperature."""

    policy: nn.Module
    device: torch.device

    def completion_logprobs(self, model: nn.Module, batch: RolloutBatch) -> Tensor: ...  # [B, C], 0 on padding


def move_text(move: str, reply_prefix: str) -> str:
    """What the model writes for `move` after a prompt that ends with `reply_prefix` (`[check]`, `[` -> `check]`)."""
    return move[len(reply_prefix) :] if reply_prefix and move.startswith(reply_prefix) else move


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout) while the block runs, then every submodule's own mode again."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def move_terminator(tokenizer, move_policy: str) -> int | None:
    """What ends a move when the policy is read over the legal moves: the tokenizer's EOS where it plays over them
    (`move_policy` `legal_moves`: `variant.move_policy`, `eval.move_policy`), nothing where it writes text."""
    return tokenizer.eos_token_id if move_policy == "legal_moves" else None


def pad_id(tokenizer) -> int:
    """The id a batch of (prompt, move) rows pads with: the tokenizer's pad token, or 0 where it has none (padding
    is masked out of every log-prob)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def move_tokens(tokenizer, move: str, reply_prefix: str, terminator: int | None = None) -> list[int]:
    """The tokens the model writes for `move` (`move_text`, tokenised alone), then `terminator` when given: the
    end of the reply, so that no move's tokens are a prefix of another's (`[1]` and `[10]` alike)."""
    ids = tokenizer(move_text(move, reply_prefix), add_special_tokens=False)["input_ids"]
    return [*ids, terminator] if terminator is not None else ids


@torch.no_grad()
def score_alternatives(
    module: ScoresCompletions,
    prompts: Sequence[list[int]],
    alternatives: Sequence[Sequence[Sequence[int]]],
    pad_token_id: int,
    rows_per_forward: int = 256,
) -> list[tuple[Tensor, list[list[float]]]]:
    """For each prompt, its alternatives' log-probs normalised over them ([K] float64: log-softmax of each
    alternative's summed token log-probs) and each alternative's token log-probs: forwards of at most
    `rows_per_forward` (prompt, alternative) rows, a prompt's alternatives in one, under a forked RNG, in eval mode."""
    out: list[tuple[Tensor, list[list[float]]]] = []
    start = 0
    while start < len(prompts):
        end, rows = start, 0
        while end < len(prompts) and (end == start or rows + len(alternatives[end]) <= rows_per_forward):
            rows += len(alternatives[end])
            end += 1
        batch_rows = [
            Rollout(list(prompts[i]), list(ids), [0.0] * len(ids), reward=0.0, group_id=i, truncated=False)
            for i in range(start, end)
            for ids in alternatives[i]
        ]
        batch = collate_rollouts(batch_rows, pad_token_id).to(module.device)
        with torch.random.fork_rng(), eval_mode(module.policy):
            logp = module.completion_logprobs(module.policy, batch)  # [R, C], 0 on padding
        logp = (logp.double() * batch.sequence_mask.double()).cpu()  # [R, C]
        per_row = logp.sum(dim=1)  # [R] log p of each alternative's tokens
        row = 0
        for i in range(start, end):
            k = len(alternatives[i])
            tokens = [logp[row + j, : len(alternatives[i][j])].tolist() for j in range(k)]
            out.append((torch.log_softmax(per_row[row : row + k], dim=0), tokens))  # [K] over the alternatives
            row += k
        start = end
    return out


def move_probabilities(
    module: ScoresCompletions,
    prompts: Sequence[list[int]],
    moves: Sequence[list[str]],
    tokenizer,
    reply_prefix: str,
    terminator: int | None = None,
    rows_per_forward: int = 256,
) -> list[dict[str, float]]:
    """For each prompt, its `moves` (the legal ones, in the game's format) with their probabilities, normalised:
    batched forwards over every (prompt, move) row; with `terminator`, each move's text and the end of the reply
    (the distribution `variant.move_policy=legal_moves` plays)."""
    options = [[move_tokens(tokenizer, m, reply_prefix, terminator) for m in ms] for ms in moves]
    scored = score_alternatives(module, prompts, options, pad_id(tokenizer), rows_per_forward)
    return [dict(zip(ms, logq.exp().tolist(), strict=True)) for ms, (logq, _) in zip(moves, scored, strict=True)]


class LegalMoveSampler:
    """Model players' moves drawn over the legal moves (self-play's `variant.move_policy=legal_moves`; GLAM, Carta
    et al. 2023, arXiv 2302.02662; TWOSOME, Tan et al. 2024, arXiv 2401.14151): each legal move's probability is
    that of its tokens and the terminator (EOS) as the completion of the turn's prompt under the weights the policy
    module holds at the time, renormalised over the legal moves; a move is drawn from that with the match's own
    `random.Random` (one uniform draw, inverse CDF), so a game seeded alike plays alike. No move is illegal, and
    what the learner trains on is that distribution (`MoveChoice`), not sampled text."""

    def __init__(self, module: ScoresCompletions, tokenizer, reply_prefix: str, rows_per_forward: int = 256) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("variant.move_policy=legal_moves ends every move with the tokenizer's EOS: it has none")
        self.module, self.tokenizer, self.reply_prefix = module, tokenizer, reply_prefix
        self.rows_per_forward = rows_per_forward
        self.pad = pad_id(tokenizer)

    def alternatives(self, legal: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        eos = self.tokenizer.eos_token_id
        return tuple(tuple(move_tokens(self.tokenizer, m, self.reply_prefix, eos)) for m in legal)

    def log_distributions(
        self, prompts: Sequence[list[int]], alternatives: Sequence[Sequence[Sequence[int]]]
    ) -> list[Tensor]:
        """Each prompt's log-probs over its alternatives (`MoveChoice.alternatives`; [K] float64), under the weights
        the module holds now (a magnet snapshot's, inside the engine's `sampling_from`)."""
        scored = score_alternatives(self.module, prompts, alternatives, self.pad, self.rows_per_forward)
        return [logq for logq, _ in scored]

    def sample(self, prompts: list[list[int]], legal: list[list[str]], rngs: list[random.Random]) -> list[MovePick]:
        options = [self.alternatives(moves) for moves in legal]
        scored = score_alternatives(self.module, prompts, options, self.pad, self.rows_per_forward)
        picks = []
        for moves, alts, (logq, tokens), rng in zip(legal, options, scored, rngs, strict=True):
            k = draw(logq.exp().tolist(), rng.random())
            completion = Completion(list(alts[k]), tokens[k], finished=True)
            picks.append(MovePick(moves[k], completion, MoveChoice(alts, k, float(logq[k]))))
        return picks


def draw(probs: Sequence[float], u: float) -> int:
    """The index whose cumulative probability first exceeds `u` in [0, 1) (the last where rounding leaves the sum
    short of `u`)."""
    total = 0.0
    for k, p in enumerate(probs):
        total += p
        if u < total:
            return k
    return len(probs) - 1


def policy_strategy(
    module: ScoresCompletions,
    encode: Callable[[TwoPlayerGame, int], list[int]],
    game: TwoPlayerGame,
    tokenizer,
    reply_prefix: str,
    terminator: int | None = None,
) -> dict[Hashable, dict[str, float]]:
    """The policy's whole strategy in a game with an exact best response (`TwoPlayerGame.responds_exactly`): its
    move distribution at a position of each information set (`strategy_positions`; Kuhn Poker's 12, 24 rows of one
    forward), keyed by `information_set`, moves in the game's format; `encode(game, player)`: the prompt ids of that
    player's turn, as the policy plays it; `terminator`: as `move_probabilities`."""
    positions = game.strategy_positions()
    prompts = [encode(position, position.current_player) for position in positions]
    legal = [p.legal_moves() for p in positions]
    found = move_probabilities(module, prompts, legal, tokenizer, reply_prefix, terminator)
    return {position.information_set(): dist for position, dist in zip(positions, found, strict=True)}


# ---- a game small enough to enumerate: the policy's exact results against scripted players --------------------


class StrategyPlayer(ScriptedPlayer):
    """The policy as a scripted player: its move distribution at each position read from `table` (by
    `exact.position_key`, the rendered board and the player to move), so its results can be computed exactly
    (games/exact.py) rather than sampled."""

    name = "policy"

    def __init__(self, table: dict[Hashable, dict[str, float]]) -> None:
        self.table = table

    def move_distribution(self, game: TwoPlayerGame) -> dict[str, float]:
        return self.table[position_key(game)]


def learner_positions(root: TwoPlayerGame, seat: int, opponent: ScriptedPlayer) -> list[TwoPlayerGame]:
    """Every position where `seat` is to move that play from `root` can reach, each once (by `position_key`): the
    learner's every legal move followed (the policy's distribution over legal moves gives each a positive
    probability), and the opponent's moves of positive probability."""
    found: dict[Hashable, TwoPlayerGame] = {}
    expanded: set[Hashable] = set()

    def visit(position: TwoPlayerGame) -> None:
        key = position_key(position)
        if position.done or key in expanded:
            return
        expanded.add(key)
        if position.current_player == seat:
            found[key] = position
            moves = position.legal_moves()
        else:
            moves = [m for m, p in opponent.move_distribution(position).items() if p > 0]
        for move in moves:
            visit(after_move(position, move))

    visit(root)
    return list(found.values())


def strategy_table(
    module: ScoresCompletions,
    encode: Callable[[TwoPlayerGame, int], list[int]],
    positions: Sequence[TwoPlayerGame],
    tokenizer,
    reply_prefix: str,
    rows_per_forward: int = 256,
    terminator: int | None = None,
) -> dict[Hashable, dict[str, float]]:
    """The policy's move distribution over the legal moves at each of `positions` (`move_probabilities`), by
    `position_key`: forwards of at most `rows_per_forward` (prompt, move) rows, a position's moves in one."""
    prompts = [encode(g, g.current_player) for g in positions]
    legal = [g.legal_moves() for g in positions]
    found = move_probabilities(module, prompts, legal, tokenizer, reply_prefix, terminator, rows_per_forward)
    return {position_key(g): dist for g, dist in zip(positions, found, strict=True)}


def exact_results(
    module: ScoresCompletions,
    encode: Callable[[TwoPlayerGame, int], list[int]],
    new_game: Callable[[], TwoPlayerGame],
    opponents: dict[str, ScriptedPlayer],
    tokenizer,
    reply_prefix: str,
    seed: int = 0,
    rows_per_forward: int = 256,
    max_moves: int | None = None,
    terminator: int | None = None,
) -> dict[str, tuple[Expected, Expected]]:
    """The policy's exact results against each scripted opponent from seat 0 and seat 1, in the game `seed` deals:
    its move distribution read at every position it can reach against that opponent (`learner_positions`, one
    forward per `strategy_table` batch, each position read once for all opponents), the games' probabilities summed
    over the whole tree (`exact.expected_results`). The policy plays a legal move (its distribution is over the
    legal moves), so the value is that of its legal play: sampled play adds its illegal moves, which lose. A game
    still going after `max_moves` moves is a draw (self-play's `max_turns`); `terminator`: as `move_probabilities`."""
    root = new_game()
    root.reset(seed)
    unique = {
        position_key(g): g
        for opponent in opponents.values()
        for seat in (0, 1)
        for g in learner_positions(root, seat, opponent)
    }
    table = strategy_table(module, encode, list(unique.values()), tokenizer, reply_prefix, rows_per_forward, terminator)
    player = StrategyPlayer(table)
    return {
        name: tuple(expected_results(root, player, opponent, seat, max_moves=max_moves) for seat in (0, 1))
        for name, opponent in opponents.items()
    }
