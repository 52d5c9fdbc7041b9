"""The records every layer passes around: a prompt, a sampled completion, a rollout, a batch of rollouts, a round.

They hold data and nothing else (no behaviour beyond shape checks and moving tensors), so the layers that make
them (data, generation, the variants, the rollout loop) and those that read them (the loss, the module, the
probes) share one definition without importing each other. Prompts are LEFT-padded and completions RIGHT-padded
in a `RolloutBatch` (TRL's layout): every completion starts at column `prompt_len`, so the completion log-probs of
the whole batch are one `[B, C]` slice of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class Prompt:
    """One problem, chat-formatted and tokenised."""

    prompt_ids: list[int]
    answer: str
    question: str
    problem_index: int
    full_length: int = 0
    """Tokens before cutting to `max_prompt_tokens` (more than len(prompt_ids) when the prompt was cut)."""
    record: object = None
    """Opaque per-problem record from the data source, handed to reward terms as `info["record"]` and to the
    evaluation's answer checker (data=reasoning_gym: the task's entry, its verifier and the asked answer format;
    None for GSM8K)."""


@dataclass(frozen=True)
class TurnRecord:
    """One learner turn of a self-play game: what reward terms read as `info["record"]` (rewards/games.py)."""

    game_id: str
    seat: int
    """The learner's seat (0 moves first)."""
    turn: int
    """The learner's turn number in its game, from 0."""
    move: str | None
    """The bracketed move found in the reply (`[4]`), None when the reply has none."""
    illegal: bool
    """The move was illegal (the game ended there, lost)."""
    outcome: float
    """The learner's result of the whole game: +1 win, 0 draw, -1 loss."""
    opponent: str
    """Who the learner played (`random`, `base`, `learner`, a snapshot's `round<NNN>`)."""
    learner_turns: int
    """How many turns the learner had in this game (`turn` runs from 0 to learner_turns - 1): a turn's distance
    from the game's end, which per-move credit reads (rewards/games.py GameOutcome.discount)."""
    payoff: float
    """The learner's payoff of the whole game in the game's unit (Kuhn Poker's chips; the outcome where that is
    all): what rewards/games.py GamePayoff scores."""


@dataclass
class Completion:
    """One sampled continuation of one prefix."""

    token_ids: list[int]
    """Sampled ids, up to and including EOS when the engine produced one."""
    logprobs: list[float]
    """Log-prob of each sampled id under the engine's (temperature-scaled) distribution."""
    finished: bool
    """False when max_new_tokens was reached without EOS (truncated)."""
    weight_version: int | None = None
    """The version of the weights that sampled it, where the engine reports one (generator=vllm_server: the pushes
    made before it was sampled); None: the engine samples the weights the trainer just synced."""
    last_weight_version: int | None = None
    """The last version that may have sampled part of it: `weight_version` unless a push landed while it was
    sampled (generator=vllm_server with `generator.push_in_flight`); None where the engine reports no version."""


@dataclass(frozen=True)
class MoveChoice:
    """A move drawn from the policy's distribution over the legal moves of a position (self-play's
    `variant.move_policy=legal_moves`, docs/selfplay.md): the rollout trains on that distribution, not on tokens."""

    alternatives: tuple[tuple[int, ...], ...]
    """Each legal move's tokens as a completion of the position's prompt: its text and the terminator (EOS), so no
    move's tokens are a prefix of another's."""
    chosen: int
    """The index in `alternatives` of the move played (its tokens are the rollout's completion)."""
    logprob: float
    """The chosen move's log-prob over the legal moves under the weights that drew it (the behaviour policy's)."""
    magnet_logprobs: tuple[float, ...] | None = None
    """The magnet strategy's log-prob of each alternative (`variant.magnet`); None: no magnet."""

    def __post_init__(self) -> None:
        if not 0 <= self.chosen < len(self.alternatives):
            raise ValueError(f"MoveChoice.chosen {self.chosen} is not one of {len(self.alternatives)} alternatives")
        if self.magnet_logprobs is not None and len(self.magnet_logprobs) != len(self.alternatives):
            raise ValueError("MoveChoice.magnet_logprobs needs one log-prob per alternative")


@dataclass
class Rollout:
    """One sampled completion of one prompt, scored, with its advantage."""

    prompt_ids: list[int]
    """Token ids of the chat-formatted prompt (no padding)."""
    completion_ids: list[int]
    """Sampled token ids, up to and including the EOS token when one was produced."""
    gen_logprobs: list[float]
    """Log-prob of each completion token under the generator's sampling distribution (len = completion)."""
    reward: float
    group_id: int
    """Samples with the same group id share one advantage baseline (docs/algorithm.md, Advantages)."""
    truncated: bool
    """True when the completion hit max_new_tokens without an EOS."""
    text: str = ""
    """Decoded completion, for logging."""
    advantage: float = 0.0
    """The completion's scalar advantage (the reward pipeline's group transforms)."""
    branch_point: int = 0
    """Number of leading completion tokens NOT trained on (STORPO continuations); 0 trains on all."""
    answer_extracted: bool = False
    """Whether the reward function found an answer in the completion (format rate)."""
    reward_terms: dict[str, float] = field(default_factory=dict)
    """Unweighted value of each reward term (`reward.terms.<name>`); `reward` is their weighted, transformed sum."""
    token_advantages: list[float] | None = None
    """Per completion token, when the variant gives tokens their own credit (STORPO's `variant.advantage=tree`,
    algorithm/tree_advantages.py); None: every trained token gets `advantage`."""
    tree: int = 0
    """Which initial completion of its group it is or continues (STORPO's forest: `variant.trees` per prompt)."""
    move_choice: MoveChoice | None = None
    """The legal moves it was drawn among, when it is a move trained over the legal moves; None: trained on tokens."""

    @classmethod
    def from_dict(cls, values: dict) -> Rollout:
        """The rollout `dataclasses.asdict` gave `values` (a checkpoint's pending round), its move choice rebuilt."""
        choice = values.get("move_choice")
        if isinstance(choice, dict):
            magnet = choice.get("magnet_logprobs")
            choice = MoveChoice(
                alternatives=tuple(tuple(ids) for ids in choice["alternatives"]),
                chosen=choice["chosen"],
                logprob=choice["logprob"],
                magnet_logprobs=None if magnet is None else tuple(magnet),
            )
        return cls(**{**values, "move_choice": choice})

    def __post_init__(self) -> None:
        for name in ("gen_logprobs", "token_advantages"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completion_ids):
                raise ValueError(
                    f"Rollout.{name} has {len(values)} entries for {len(self.completion_ids)} completion tokens"
                )


@dataclass
class MoveRows:
    """The legal moves of a batch's rollouts, for a loss over moves (`MoveChoice`): every alternative of every
    rollout as one row of `rows` (its prompt, its tokens), rollout by rollout, and where each rollout's alternatives
    sit."""

    rows: RolloutBatch
    """R rows: rollout 0's alternatives, then rollout 1's, ..."""
    slots: Tensor  # [B, K] long, the row of rollout b's k-th alternative (0 where it has fewer than K)
    slot_mask: Tensor  # [B, K] bool, True on real alternatives
    chosen: Tensor  # [B] long, the slot of the move played
    old_logprobs: Tensor  # [B] float32, the chosen move's log-prob over the legal moves when it was drawn
    magnet_logprobs: Tensor | None = None  # [B, K] float32, the magnet's log-probs (0 off the mask); None: none

    def to(self, device: torch.device | str) -> MoveRows:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if getattr(self, f.name) is not None}
        return replace(self, **moved)


@dataclass
class RolloutBatch:
    """Padded tensors of B rollouts, ready for a forward pass.

    Column layout of `input_ids`: [left pad | prompt | completion | right pad]; completion token j of every
    row sits at column `prompt_len + j`.
    """

    input_ids: Tensor  # [B, P + C] long
    attention_mask: Tensor  # [B, P + C] long, 1 on real tokens
    completion_mask: Tensor  # [B, C] float, 1 on trained completion tokens (after the branch point)
    gen_logprobs: Tensor  # [B, C] float32, generator log-probs (0 on padding)
    advantages: Tensor  # [B] float32, each completion's scalar advantage
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] long
    branch_points: Tensor  # [B] long, leading completion tokens not trained on (STORPO continuations; else 0)
    prompt_len: int
    """P: width of the left-padded prompt block."""
    token_advantages: Tensor | None = None  # [B, C] float32 per-token advantages (0 on padding); None: `advantages`
    old_logprobs: Tensor | None = None  # [B, C] float32, policy log-probs before the round's first update
    num_tokens_in_step: float = 0.0
    """Trained tokens in the whole optimizer step this micro-batch belongs to (step-normalised loss types); moves
    where the batch trains over moves (`trained_units`)."""
    moves: MoveRows | None = None
    """Every rollout's legal moves when the batch trains over moves (`Rollout.move_choice`); None: over tokens."""

    @property
    def trained_units(self) -> float:
        """What a step-normalised loss counts in this micro-batch: its trained tokens, or its moves (one a row)
        when it trains over moves."""
        return float(len(self)) if self.moves is not None else float(self.completion_mask.sum())

    @property
    def completion_ids(self) -> Tensor:  # [B, C]
        return self.input_ids[:, self.prompt_len :]

    @property
    def loss_advantages(self) -> Tensor:  # [B] or [B, C]
        """What the loss weighs tokens by: `token_advantages` when the variant set them, else the scalar per row."""
        return self.advantages if self.token_advantages is None else self.token_advantages

    @property
    def advantages_per_token(self) -> Tensor:  # [B, C]
        """Every completion column's advantage: `token_advantages`, or each row's scalar repeated along it."""
        if self.token_advantages is not None:
            return self.token_advantages
        return self.advantages[:, None].expand(-1, self.completion_mask.shape[1])

    @property
    def sequence_mask(self) -> Tensor:  # [B, C] real (non-pad) completion tokens, trained or not
        return self.attention_mask[:, self.prompt_len :].float()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)
        }
        if self.moves is not None:
            moved["moves"] = self.moves.to(device)
        return replace(self, **moved)


@dataclass(frozen=True)
class Round:
    """One round as the data module serves it; built by `RolloutLoop.install`, never changed afterwards."""

    index: int
    rollouts: tuple[Rollout, ...]
    micro_batches: tuple[RolloutBatch, ...]
    """Whole advantage groups each, in group order; with `old_logprobs` when several optimizer steps use them."""
    schedule: tuple[RolloutBatch, ...]
    """What the data loader serves: `num_iterations` passes over the micro-batches, each entry carrying the
    trained-token count of its optimizer step over all ranks (`num_tokens_in_step`, for step-normalised loss types)."""
