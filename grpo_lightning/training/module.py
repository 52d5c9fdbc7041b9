"""GRPOModule: the policy, its reference, and the GRPO loss (docs/algorithm.md; Shao et al. 2024) as a LightningModule.

One training step is one micro-batch of whole advantage groups; Lightning accumulates `accumulate_grad_batches`
of them per optimizer step and divides each loss by that count; what that means per loss type is the loss's
business (`LossType.step_loss`: a step-normalised type undoes it, TRL issue #3021).

Old log-probs: when one optimizer step consumes a round, old_logp = logp.detach() (ratio 1, gradient intact);
otherwise the rollout loop stores policy log-probs computed once before the round's first update
(`score_old_logprobs`), because "detached current" is wrong after the first update. The generator's log-probs go
to the loss as well: where the engine samples from another policy, `loss.rollout_correction` weighs the
policy-gradient term by pi_old / pi_gen (algorithm/rollout_correction.py, docs/algorithm.md).

Positions are derived from the attention mask so left-padded rows score exactly as HF `generate` sampled them;
`rollout/logp_diff_*` (generator vs trainer log-prob on the same tokens, grpo_lightning/training/rollout_loop.py) checks
it every round.

Non-finite guard: a NaN/inf loss or gradient skips the optimizer step by dropping every `.grad` before the
step (torch optimizers leave parameters without a gradient untouched: no Adam moment update, no weight decay),
so Lightning's step counters and the LR schedule advance as usual. Skips are counted (`train/skipped_steps`);
after `max_consecutive_skips` in a row the run stops at the end of the round with a checkpoint and
`stop_reason` set (train.py turns it into a clear error).

Divergence guard: a step can also blow the parameters up while every number stays finite (a huge lr: Adam moves
every weight by about lr per step, whatever the gradient). After each optimizer step the global norm of the
trainable parameters is compared with its value before the step; more than `max_norm_growth` times larger, or
non-finite, and the run is marked `diverged` and stops at the end of the round WITHOUT saving it
(checkpointing.py), so the newest checkpoint holds the weights from before the divergence. The stop message names
the likely cause (the lr for an exploding update, the temperature or the lr for non-finite losses).

Resuming: Lightning restores the optimizer's param groups and the scheduler's base lrs from the checkpoint;
`on_train_start` writes this run's optimizer settings (lr, weight decay, betas, ...) over them, so a resume with
a new lr or schedule trains with it (a resume with unchanged settings computes the very same lr, bit for bit).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import lightning as L
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from grpo_lightning.accel import ForwardSettings
from grpo_lightning.accel.completion_forward import completion_logits_and_logprobs, completion_logprobs_with_entropy
from grpo_lightning.accel.entropy_terms import EntropyTerms
from grpo_lightning.algorithm.losses import GRPOLoss, aggregate, move_terms
from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.schema import check_settings, choice, integer, number, setting
from grpo_lightning.sharding import call_as_forward, is_sharded, shard_module, sharded_norm
from grpo_lightning.types import MoveRows, RolloutBatch

log = logging.getLogger(__name__)


SCHEDULE_KINDS = ("constant", "linear", "cosine")
ForwardNeed = Literal["logprobs", "entropy", "entropy_gradient"]  # each more than the last


class ForwardObserver(Protocol):
    """What the training step calls on every observer added (a probe reading the forward: probes/base.py
    `ForwardProbe`). Why observers, not flags a probe sets here: the module names no probe; any probe can read."""

    def forward_need(self, batch: RolloutBatch) -> ForwardNeed | None:
        """What it needs of this micro-batch's forward; None: it does not observe this one."""

    def observe_forward(self, batch: RolloutBatch, logp: Tensor, terms: EntropyTerms | None) -> None:
        """The micro-batch, its log-probs [B, C] (in the loss's graph) and entropy terms (None if none needed)."""


@dataclass(frozen=True)
class LRSchedule:
    """`optim.schedule`: linear warmup then constant, linear or cosine decay to `min_ratio` x lr."""

    kind: str = setting("constant", choice(*SCHEDULE_KINDS))
    warmup_steps: int = setting(1, integer(0))
    min_ratio: float = setting(0.0, number(low=0, high=1))

    def __post_init__(self) -> None:
        check_settings(self, "optim.schedule")

    def factor(self, step: int, total_steps: int) -> float:
        """Multiplier of the base lr at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        decay = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * decay


class GRPOModule(L.LightningModule):
    def __init__(
        self,
        policy: nn.Module,
        reference: nn.Module | None,
        loss: GRPOLoss,
        optimizer: Callable[..., torch.optim.Optimizer],
        schedule: LRSchedule,
        total_steps: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        max_consecutive_skips: int = 3,
        max_norm_growth: float | None = 2.0,
        run_info: dict | None = None,
        fixed_settings: dict | None = None,
        forward_settings: ForwardSettings | None = None,
    ) -> None:
        """`run_info` (model, LoRA) is what a checkpoint must match to be resumed; `fixed_settings` are the config
        keys a resume may not change (checkpointing.FIXED_ON_RESUME). Both are saved in every checkpoint.
        `temperature`, `top_k` and `top_p` are the generator's: log-probs are scored on the distribution the
        engine sampled from (algorithm/truncation.py)."""
        super().__init__()
        if max_consecutive_skips < 1:
            raise ValueError(f"guard.max_consecutive_skipped_steps must be >= 1 (got {max_consecutive_skips})")
        self.policy = policy
        self.reference = reference
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.schedule = schedule
        self.total_steps = total_steps
        self.temperature = temperature
        self.truncation = Truncation(top_k, top_p)
        """The top-k / top-p the engine samples with, replayed on every log-prob the trainer scores."""
        self.forward_settings = forward_settings if forward_settings is not None else ForwardSettings()
        """How the training forward computes log-probs (`perf.forward`; accel/completion_forward.py)."""
        self.strict_loading = False  # checkpoints hold trainable weights only (see on_save_checkpoint)
        self.forward_observers: list[ForwardObserver] = []  # called with each training forward, in order added
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.stop_reason: str | None = None
        self.max_norm_growth = max_norm_growth
        self.diverged = False
        """Set when a step blew the parameters up; nothing is saved from then on (checkpointing.py)."""
        self._norm_before_step: float | None = None
        self.last_old_logprobs: Tensor | None = None
        """[B, C] the old log-probs the last training step's loss used (the rollout loop's logp agreement)."""
        self.last_batch: RolloutBatch | None = None
        """The micro-batch of the last training step (with `last_old_logprobs`)."""
        self.run_info = dict(run_info or {})
        self.fixed_settings = dict(fixed_settings or {})

    def configure_model(self) -> None:
        """trainer=fsdp: shard the policy (and a full reference) over the processes (grpo_lightning/sharding.py). Every
        other strategy sets no device mesh, and the modules stay as they are."""
        mesh = self.device_mesh
        if mesh is None:
            return
        # Every backbone call gathers each decoder layer (a collective), so each process must make as many calls as
        # the others, whatever the rows of its micro-batch: one per forward (grpo_lightning/sharding.py).
        self.forward_settings = self.forward_settings.one_backbone_call()
        if is_sharded(self.policy):
            return
        shard_module(self.policy, mesh["data_parallel"])
        if self.reference is not None:
            shard_module(self.reference, mesh["data_parallel"])

    # ---- log-probs -----------------------------------------------------------------------------------------
    def policy_forward(
        self, model: nn.Module, batch: RolloutBatch, with_logits: bool = False
    ) -> tuple[Tensor | None, Tensor]:
        """Logits at completion positions [B, C, V] (divided by the temperature) and completion log-probs [B, C].

        Logits are materialised only when asked (`with_logits`), else None; the log-probs come from the chunked
        LM head either way. Prompts shared by several rows run once (`share_prefix`). See
        `grpo_lightning.accel.completion_forward`.
        """
        levers = self.forward_settings
        return call_as_forward(  # trainer=fsdp: the root's parameters gathered around it (grpo_lightning/sharding.py)
            model,
            completion_logits_and_logprobs,
            model,
            batch,
            self.temperature,
            with_logits,
            levers.share_prefix,
            levers.logits_chunk_tokens,
            levers.runs_by_length,
            self.truncation,
        )

    def completion_logprobs(self, model: nn.Module, batch: RolloutBatch) -> Tensor:  # [B, C]
        """log pi(completion token | prefix) at the sampling temperature, over the tokens top-k / top-p keep."""
        return self.policy_forward(model, batch, with_logits=False)[1]

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[nn.Module]:
        """The reference model while the block runs: the reference's own copy, or with LoRA the policy with its
        adapter off (the base model)."""
        if self.reference is not None:
            yield self.reference
            return
        with self.policy.disable_adapter():
            yield self.policy

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor | None:  # [B, C]
        if not self.loss_fn.needs_reference:
            return None
        with self.reference_model() as model:
            return self.completion_logprobs(model, batch)

    def move_logprobs(self, model: nn.Module, moves: MoveRows) -> tuple[Tensor, Tensor]:  # [B, K], [R, C']
        """(log pi of each legal move of each position, renormalised over its legal moves, -inf off the mask; the
        token log-probs of every row). A move's log-prob is the sum of its tokens' (its text and the terminator)
        at the sampling temperature, as self-play drew it (games/policy_moves.py `LegalMoveSampler`)."""
        row_logp = self.completion_logprobs(model, moves.rows)  # [R, C']
        per_row = (row_logp * moves.rows.sequence_mask).sum(dim=1)  # [R] log p(the move's tokens | prompt)
        per_slot = per_row[moves.slots].masked_fill(~moves.slot_mask, float("-inf"))  # [B, K]
        return per_slot - torch.logsumexp(per_slot, dim=1, keepdim=True), row_logp

    @torch.no_grad()
    def score_old_logprobs(self, batch: RolloutBatch) -> Tensor:  # [B, C]
        return self.completion_logprobs(self.policy, batch)

    def sample_weights(self, batch: RolloutBatch) -> Tensor:  # [B]
        """Weight of each completion in this micro-batch's loss (the loss type's, `GRPOLoss.sample_weights`); a
        batch over moves weighs each move as a completion of one unit."""
        if batch.moves is not None:
            return self.loss_fn.sample_weights(torch.ones((len(batch), 1), device=batch.completion_mask.device))
        return self.loss_fn.sample_weights(batch.completion_mask)

    @property
    def step_weighting(self) -> str:
        """How the optimizer step weighs micro-batches (the loss type's, `GRPOLoss.step_weighting`)."""
        return self.loss_fn.step_weighting

    # ---- training ------------------------------------------------------------------------------------------
    def add_forward_observer(self, observer: ForwardObserver) -> None:
        """Call `observer` with every training micro-batch's forward (a probe, at the start of fit)."""
        self.forward_observers.append(observer)

    def remove_forward_observer(self, observer: ForwardObserver) -> None:
        """Stop calling `observer` (a probe, at teardown); one that was never added is no error."""
        self.forward_observers = [o for o in self.forward_observers if o is not observer]

    def step_forward(self, batch: RolloutBatch) -> tuple[Tensor, EntropyTerms | None]:  # [B, C], terms
        """The training step's forward: log-probs [B, C], and the same logits' token entropies where an observer or
        the entropy bonus needs them (the log-probs bitwise the same either way); then each observer is called."""
        observing = [(o, need) for o in self.forward_observers if (need := o.forward_need(batch)) is not None]
        bonus = self.loss_fn.entropy_coef != 0
        if not bonus and all(need == "logprobs" for _, need in observing):
            logp, terms = self.policy_forward(self.policy, batch)[1], None
        else:
            logp, terms = call_as_forward(
                self.policy,
                completion_logprobs_with_entropy,
                self.policy,
                batch,
                self.temperature,
                batch.completion_mask,
                self.forward_settings.share_prefix,
                self.forward_settings.logits_chunk_tokens,
                self.forward_settings.runs_by_length,
                with_grad=bonus or any(need == "entropy_gradient" for _, need in observing),
                truncation=self.truncation,
            )
        for observer, _ in observing:
            observer.observe_forward(batch, logp, terms)
        return logp, terms

    def entropy_bonus(self, batch: RolloutBatch, terms: EntropyTerms) -> tuple[Tensor, Tensor]:  # [], []
        """(the term the step subtracts from its loss, the micro-batch's token-mean entropy): `loss.entropy_coef`
        times the token-mean entropy of the temperature-scaled policy over the micro-batch's trained tokens, as TRL
        adds it whatever the loss type (`GRPOLoss.entropy_bonus`)."""
        mask = batch.completion_mask
        tokens = mask.sum().clamp(min=1)
        entropy_mean = (terms.entropy * mask).sum().float() / tokens
        return self.loss_fn.entropy_bonus(entropy_mean, terms.gradient_surrogate() / tokens), entropy_mean

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        if batch.moves is not None:
            return self.move_training_step(batch)
        logp, terms = self.step_forward(batch)  # [B, C]
        old_logp = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        self.last_old_logprobs = old_logp  # [B, C] the rollout loop compares the unscored ones with the generator's
        self.last_batch = batch
        ref_logp = self.reference_logprobs(batch)
        mask, gen_logp = batch.completion_mask, batch.gen_logprobs  # the generator's: the rollout correction's
        advantages = batch.loss_advantages  # [B], or [B, C] with per-token credit (STORPO's variant.advantage=tree)
        out = self.loss_fn(logp, old_logp, ref_logp, advantages, mask, batch.num_tokens_in_step, gen_logp)
        loss = self.loss_fn.step_loss(out.loss, self.trainer.accumulate_grad_batches, self.trainer.world_size)
        b = len(batch)
        if self.loss_fn.entropy_coef != 0:  # after step_loss: a micro-batch mean whatever the loss type
            bonus, entropy_mean = self.entropy_bonus(batch, terms)
            loss = loss - bonus
            self.log("train/entropy", entropy_mean, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)
        metrics = {
            "train/loss": loss.detach(),
            "train/kl": out.kl_mean,
            "train/clip_ratio": out.clip_ratio,
            "train/clip_ratio_low": out.clip_ratio_low,
            "train/clip_ratio_high": out.clip_ratio_high,
        }
        if out.correction is not None:  # loss.rollout_correction (docs/algorithm.md)
            metrics.update(out.correction.metrics())
            largest = {"on_step": False, "on_epoch": True, "batch_size": b, "sync_dist": True, "reduce_fx": "max"}
            self.log("train/is_ratio_max", out.correction.ratio_max, **largest)
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)  # mean over ranks
        return loss

    def move_training_step(self, batch: RolloutBatch) -> Tensor:
        """A step over moves (self-play's `variant.move_policy=legal_moves`, docs/selfplay.md): the clipped
        surrogate of each played move's probability over its position's legal moves against the probability it was
        drawn with (the loss type's aggregation, a move one unit), plus `loss.beta` x KL to the reference and
        `loss.magnet_coef` x KL to the magnet, minus `loss.entropy_coef` x the entropy: each exact over the legal
        moves (`move_terms`). Forward observers (probes reading token forwards) are not called: there are no
        sampled tokens to read, and the config check refuses them beside it."""
        moves = batch.moves
        logq, row_logp = self.move_logprobs(self.policy, moves)  # [B, K], [R, C']
        played = logq.gather(1, moves.chosen[:, None])  # [B, 1]
        ones = torch.ones_like(played)
        out = self.loss_fn.over_moves()(
            played, moves.old_logprobs[:, None].to(played.dtype), None, batch.advantages, ones, batch.num_tokens_in_step
        )
        ref_logq = None
        if self.loss_fn.beta > 0:
            with torch.no_grad(), self.reference_model() as model:
                ref_logq = self.move_logprobs(model, moves)[0]
        terms = move_terms(logq, moves.slot_mask, ref_logq, moves.magnet_logprobs)
        loss = out.loss
        regularised = torch.zeros_like(terms.entropy)  # [B]
        if terms.kl_reference is not None:
            regularised = regularised + self.loss_fn.beta * terms.kl_reference
        if terms.kl_magnet is not None and self.loss_fn.magnet_coef != 0:
            regularised = regularised + self.loss_fn.magnet_coef * terms.kl_magnet
        if terms.kl_reference is not None or terms.kl_magnet is not None:
            loss = loss + aggregate(regularised[:, None], ones, self.loss_fn.loss_type, 1, batch.num_tokens_in_step)
        loss = self.loss_fn.step_loss(loss, self.trainer.accumulate_grad_batches, self.trainer.world_size)
        if self.loss_fn.entropy_coef != 0:  # after step_loss: a micro-batch mean whatever the loss type
            loss = loss - self.loss_fn.entropy_coef * terms.entropy.mean()
        played_rows = moves.slots.gather(1, moves.chosen[:, None]).squeeze(1)  # [B]
        self.last_old_logprobs = row_logp[played_rows, : batch.completion_mask.shape[1]].detach()  # [B, C]
        self.last_batch = batch
        b = len(batch)
        metrics = {
            "train/loss": loss.detach(),
            "train/kl": terms.kl_reference.mean().detach() if terms.kl_reference is not None else out.kl_mean,
            "train/move_entropy": terms.entropy.mean().detach(),
            "train/clip_ratio": out.clip_ratio,
            "train/clip_ratio_low": out.clip_ratio_low,
            "train/clip_ratio_high": out.clip_ratio_high,
        }
        if terms.kl_magnet is not None:
            metrics["train/magnet_kl"] = terms.kl_magnet.mean().detach()
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.max_norm_growth is not None:
            self._norm_before_step = self.trainable_norm()
        params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = grad_norm([p.grad for p in params])  # before clipping; under DDP the grads are already synced
        if math.isfinite(norm):
            self.consecutive_skips = 0
            self.log("train/grad_norm", norm, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
        else:
            self.skip_step(params)
        skipped = float(self.skipped_steps)  # equal on every rank (the gradients are synced)
        self.log("train/skipped_steps", skipped, on_step=False, on_epoch=True, reduce_fx="max", sync_dist=True)
        lr = optimizer.param_groups[0]["lr"]
        self.log("train/lr", lr, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)

    def skip_step(self, params: list[nn.Parameter]) -> None:
        """Drop this step's gradients so `optimizer.step()` leaves every parameter and its state as it was."""
        for p in params:
            p.grad = None
        self.skipped_steps += 1
        self.consecutive_skips += 1
        log.warning(
            "non-finite loss or gradient at step %d: optimizer step skipped (%d in a row, %d in total)",
            self.global_step,
            self.consecutive_skips,
            self.skipped_steps,
        )
        if self.consecutive_skips >= self.max_consecutive_skips:
            self.stop_reason = (
                f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or gradient "
                f"(guard.max_consecutive_skipped_steps={self.max_consecutive_skips}); the parameters are those "
                f"of the last finite step. {self.likely_cause()}"
            )
            self.trainer.should_stop = True

    def trainable_norm(self) -> float:
        """Global L2 norm of the trainable parameters (inf/nan when any entry is)."""
        return grad_norm([p.detach() for p in self.policy.parameters() if p.requires_grad])

    def current_lr(self) -> float:
        group = self.trainer.optimizers[0].param_groups[0]
        return float(group.get("initial_lr", group["lr"]))

    def likely_cause(self) -> str:
        """What most likely made the loss non-finite, in config keys."""
        from grpo_lightning.generation.base import LOW_TEMPERATURE

        if self.temperature < LOW_TEMPERATURE:
            return (
                f"Likely cause: generator.temperature={self.temperature:g} is so low that logits / temperature "
                "overflow; use a temperature near 1"
            )
        return (
            f"Likely causes: optim.optimizer.lr={self.current_lr():g} too large (lower it and resume), or a reward "
            "that returns NaN or inf"
        )

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """The step, then the divergence check (the closure runs `on_before_optimizer_step` first)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        before, self._norm_before_step = self._norm_before_step, None
        if before is None or self.diverged:
            return
        after = self.trainable_norm()
        exploded = not math.isfinite(after) or (before > 0 and after > self.max_norm_growth * before)
        # Any rank: under FSDP each rank sees only its shard of the parameters; all must stop together.
        if not self.trainer.strategy.reduce_boolean_decision(exploded, all=False):
            return
        self.diverged = True
        self.stop_reason = (
            f"the run diverged at optimizer step {self.global_step - 1}: the trainable parameters' norm went from "
            f"{before:.4g} to {after:.4g} in one step (guard.max_norm_growth={self.max_norm_growth:g}). Likely "
            f"cause: optim.optimizer.lr={self.current_lr():g} is too large for this model; lower it"
        )
        log.error("%s", self.stop_reason)
        self.trainer.should_stop = True

    def on_train_start(self) -> None:
        """On resume: this run's optimizer settings over the restored ones (see the module docstring)."""
        if self.trainer.ckpt_path is None:
            return
        optimizer = self.trainer.optimizers[0]
        settings = optimizer.defaults  # built by configure_optimizers from this run's config: lr, betas, ...
        restored_lr = optimizer.param_groups[0].get("initial_lr")
        for group in optimizer.param_groups:
            group.update({k: v for k, v in settings.items() if k != "params"})
            group["initial_lr"] = settings["lr"]
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            scheduler.base_lrs = [settings["lr"]] * len(optimizer.param_groups)
            for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
                group["lr"] = settings["lr"] * factor(scheduler.last_epoch)  # what LambdaLR.step() computes
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        if restored_lr != settings["lr"]:
            log.info("resumed with optim.optimizer.lr=%g (the checkpoint's run had %g)", settings["lr"], restored_lr)

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the policy has no trainable parameters (check model.lora.target_modules)")
        optimizer = self.optimizer_factory(params)
        total = max(1, self.total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.schedule.factor(step, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep only trainable weights: the frozen base, tied copies and the reference come back from the source."""
        trainable = {f"policy.{n}" for n, p in self.policy.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["grpo_lightning"] = {
            "run_info": self.run_info,
            "fixed_settings": self.fixed_settings,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("grpo_lightning", {})
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)


def grad_norm(grads: list[Tensor]) -> float:
    """Global L2 norm of the gradients (inf/nan when any entry is); 0.0 when there are none. FSDP shards
    (trainer=fsdp): the norm over every process's shards (grpo_lightning/sharding.py)."""
    if not grads:
        return 0.0
    if all(isinstance(g, DTensor) for g in grads):
        return sharded_norm(grads)
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
