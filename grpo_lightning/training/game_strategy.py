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
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.games import kuhn_poker
from grpo_lightning.games.base import TwoPlayerGame
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


def kuhn_strategy(
    module: ScoresCompletions, encode: Callable[[TwoPlayerGame, int], list[int]], tokenizer, reply_prefix: str
) -> dict[tuple[int, str], dict[str, float]]:
    """The policy's Kuhn Poker strategy (`kuhn_poker.Strategy`) at its 12 information sets, 24 rows of one forward;
    `encode(game, player)`: the prompt ids of that player's turn, as the policy plays it."""
    positions = [kuhn_poker.position(card, history) for card, history in kuhn_poker.INFOSETS]
    prompts = [encode(game, game.current_player) for game in positions]
    found = move_probabilities(module, prompts, [g.legal_moves() for g in positions], tokenizer, reply_prefix)
    return {
        key: {move[1:-1]: p for move, p in dist.items()} for key, dist in zip(kuhn_poker.INFOSETS, found, strict=True)
    }
