"""The policy's strategy in a game, read from its probabilities rather than from play: at each information set, the
probability of each legal move's text, normalised over the legal moves (docs/selfplay.md, "Exploitability (Kuhn
Poker)").

A move's probability is that of its text as the completion of the turn's prompt, the prompt the policy plays from
(`TurnPrompts`: chat template, observation, reply prefix): the product of its tokens' probabilities at the
training temperature, the distribution the policy samples from (without `generator.top_p` / `top_k`). The text is
the move less the reply prefix the prompt already ends with (`[check]` after `[` is `check]`), tokenised alone.
Normalising over the legal moves gives the strategy of a policy that plays a legal move: what the game reads from
a reply that starts with a move's text. Every move of every information set is one row of one batched forward of
the training module (`GRPOModule.completion_logprobs`), under no gradient, in eval mode, under a forked RNG:
training's state is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.games.base import TwoPlayerGame
from grpo_lightning.games.exact import Expected, after_move, expected_results, position_key
from grpo_lightning.games.play import ScriptedPlayer
from grpo_lightning.types import Rollout, RolloutBatch


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


@torch.no_grad()
def move_probabilities(
    module: ScoresCompletions, prompts: Sequence[list[int]], moves: Sequence[list[str]], tokenizer, reply_prefix: str
) -> list[dict[str, float]]:
    """For each prompt, its `moves` (the legal ones, in the game's format) with their probabilities, normalised:
    one batched forward over every (prompt, move) row."""
    rollouts = []
    for group, (prompt, options) in enumerate(zip(prompts, moves, strict=True)):
        for move in options:
            ids = tokenizer(move_text(move, reply_prefix), add_special_tokens=False)["input_ids"]
            rollouts.append(Rollout(list(prompt), ids, [0.0] * len(ids), reward=0.0, group_id=group, truncated=False))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = collate_rollouts(rollouts, pad).to(module.device)
    with torch.random.fork_rng(), eval_mode(module.policy):
        logp = module.completion_logprobs(module.policy, batch)  # [B, C], 0 on padding
    per_move = (logp.double() * batch.sequence_mask.double()).sum(dim=1).cpu()  # [B] log p of each move's text
    out, row = [], 0
    for options in moves:
        probs = torch.softmax(per_move[row : row + len(options)], dim=0)  # [moves], over the legal moves
        out.append(dict(zip(options, probs.tolist(), strict=True)))
        row += len(options)
    return out


def policy_strategy(
    module: ScoresCompletions,
    encode: Callable[[TwoPlayerGame, int], list[int]],
    game: TwoPlayerGame,
    tokenizer,
    reply_prefix: str,
) -> dict[Hashable, dict[str, float]]:
    """The policy's whole strategy in a game with an exact best response (`TwoPlayerGame.responds_exactly`): its
    move distribution at a position of each information set (`strategy_positions`; Kuhn Poker's 12, 24 rows of one
    forward), keyed by `information_set`, moves in the game's format; `encode(game, player)`: the prompt ids of that
    player's turn, as the policy plays it."""
    positions = game.strategy_positions()
    prompts = [encode(position, position.current_player) for position in positions]
    found = move_probabilities(module, prompts, [p.legal_moves() for p in positions], tokenizer, reply_prefix)
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
) -> dict[Hashable, dict[str, float]]:
    """The policy's move distribution over the legal moves at each of `positions` (`move_probabilities`), by
    `position_key`: forwards of at most `rows_per_forward` (prompt, move) rows, a position's moves in one."""
    table: dict[Hashable, dict[str, float]] = {}
    batch: list[TwoPlayerGame] = []
    rows = 0

    def flush() -> None:
        prompts = [encode(g, g.current_player) for g in batch]
        found = move_probabilities(module, prompts, [g.legal_moves() for g in batch], tokenizer, reply_prefix)
        table.update((position_key(g), dist) for g, dist in zip(batch, found, strict=True))

    for position in positions:
        moves = len(position.legal_moves())
        if batch and rows + moves > rows_per_forward:
            flush()
            batch, rows = [], 0
        batch.append(position)
        rows += moves
    if batch:
        flush()
    return table


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
) -> dict[str, tuple[Expected, Expected]]:
    """The policy's exact results against each scripted opponent from seat 0 and seat 1, in the game `seed` deals:
    its move distribution read at every position it can reach against that opponent (`learner_positions`, one
    forward per `strategy_table` batch, each position read once for all opponents), the games' probabilities summed
    over the whole tree (`exact.expected_results`). The policy plays a legal move (its distribution is over the
    legal moves), so the value is that of its legal play: sampled play adds its illegal moves, which lose. A game
    still going after `max_moves` moves is a draw (self-play's `max_turns`)."""
    root = new_game()
    root.reset(seed)
    unique = {
        position_key(g): g
        for opponent in opponents.values()
        for seat in (0, 1)
        for g in learner_positions(root, seat, opponent)
    }
    table = strategy_table(module, encode, list(unique.values()), tokenizer, reply_prefix, rows_per_forward)
    player = StrategyPlayer(table)
    return {
        name: tuple(expected_results(root, player, opponent, seat, max_moves=max_moves) for seat in (0, 1))
        for name, opponent in opponents.items()
    }
