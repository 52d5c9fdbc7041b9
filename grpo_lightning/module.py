"""GRPOModule: the policy, its reference, and the GRPO loss (docs/algorithm.md; Shao et al. 2024) as a LightningModule.

One training step is one micro-batch of whole advantage groups; Lightning accumulates `accumulate_grad_batches`
of them per optimizer step and divides each loss by that count. That division is right for `grpo`, `bnpo` and
`dr_grpo` (a mean of per-micro-batch losses, as TRL does) but not for `dapo`, whose loss is already normalised
by the token count of the whole optimizer step (all micro-batches, all ranks): it is multiplied back by the
accumulation count and by the world size, since DDP averages gradients over ranks (TRL issue #3021).

Old log-probs: when one optimizer step consumes a round, old_logp = logp.detach() (ratio 1, gradient intact);
otherwise the rollout callback stores policy log-probs computed once before the round's first update
(`score_old_logprobs`), because "detached current" is wrong after the first update.

Positions are derived from the attention mask so left-padded rows score exactly as HF `generate` sampled them;
`rollout/logp_diff_*` (generator vs trainer log-prob on the same tokens) checks it every round.

Non-finite guard: a NaN/inf loss or gradient skips the optimizer step by dropping every `.grad` before the
step (torch optimizers leave parameters without a gradient untouched: no Adam moment update, no weight decay),
so Lightning's step counters and the LR schedule advance as usual. Skips are counted (`train/skipped_steps`);
after `max_consecutive_skips` in a row the run stops at the end of the round with a checkpoint and
`stop_reason` set (train.py turns it into a clear error).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor, nn

from grpo_lightning.forward import completion_logits_and_logprobs
from grpo_lightning.losses import GRPOLoss
from grpo_lightning.rollouts import RolloutBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LRSchedule:
    """`optim.schedule`: linear warmup then constant, linear or cosine decay to `min_ratio` x lr."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.schedule.kind must be one of constant, linear, cosine (got {self.kind!r})")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.schedule.warmup_steps must be >= 0 (got {self.warmup_steps})")

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
        max_consecutive_skips: int = 3,
    ) -> None:
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
        self.strict_loading = False  # checkpoints hold trainable weights only (see on_save_checkpoint)
        self.logits_observer: Callable[[Tensor, Tensor, RolloutBatch], None] | None = None  # set by probes
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.stop_reason: str | None = None
        self.run_info: dict = {}
        """What a checkpoint must match to be resumed (model, LoRA); set by train.build_run, saved in checkpoints."""

    # ---- log-probs -----------------------------------------------------------------------------------------
    share_prefix: bool = True
    """Run each distinct prompt of a micro-batch once and reuse its KV cache for its completions (forward.py)."""
    logits_chunk_tokens: int | None = 128
    """Completion positions per chunk of the LM head + log-softmax (forward.py; None: materialise the [B, C, V]
    logits and take the log-probs from them)."""
    runs_by_length: bool = True
    """Run rows in runs of similar completion length, each only as far as its longest row (forward.py)."""

    def policy_forward(
        self, model: nn.Module, batch: RolloutBatch, with_logits: bool | None = None
    ) -> tuple[Tensor | None, Tensor]:
        """Logits at completion positions [B, C, V] (divided by the temperature) and completion log-probs [B, C].

        Logits are materialised only when asked (`with_logits`; None = when a probe observes them), else None;
        the log-probs come from the chunked LM head either way. Prompts shared by several rows run once
        (`share_prefix`). See `grpo_lightning.forward`.
        """
        if with_logits is None:
            with_logits = self.logits_observer is not None
        return completion_logits_and_logprobs(
            model,
            batch,
            self.temperature,
            with_logits,
            self.share_prefix,
            self.logits_chunk_tokens,
            self.runs_by_length,
        )

    def completion_logprobs(self, model: nn.Module, batch: RolloutBatch) -> Tensor:  # [B, C]
        """log pi(completion token | prefix) at the sampling temperature."""
        return self.policy_forward(model, batch, with_logits=False)[1]

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor | None:  # [B, C]
        if not self.loss_fn.needs_reference:
            return None
        if self.reference is not None:
            return self.completion_logprobs(self.reference, batch)
        with self.policy.disable_adapter():  # LoRA: the base model is the reference
            return self.completion_logprobs(self.policy, batch)

    @torch.no_grad()
    def score_old_logprobs(self, batch: RolloutBatch) -> Tensor:  # [B, C]
        return self.completion_logprobs(self.policy, batch)

    def sample_weights(self, batch: RolloutBatch) -> Tensor:  # [B]
        """Relative weight of each completion's token-mean loss in this micro-batch's loss (for ESS).

        `grpo` averages completions equally; `bnpo`, `dr_grpo` and `dapo` sum tokens, so a completion weighs
        in proportion to its trained tokens. Completions with no trained token weigh 0.
        """
        tokens = batch.completion_mask.sum(-1)  # [B]
        return (tokens > 0).float() if self.loss_fn.loss_type == "grpo" else tokens

    # ---- training ------------------------------------------------------------------------------------------
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        logits, logp = self.policy_forward(self.policy, batch)  # [B, C, V], [B, C]
        if self.logits_observer is not None:  # a probe reads the live logits (entropy); it never changes them
            self.logits_observer(logits, logp, batch)
        old_logp = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        ref_logp = self.reference_logprobs(batch)
        out = self.loss_fn(logp, old_logp, ref_logp, batch.advantages, batch.completion_mask, batch.num_tokens_in_step)
        loss = out.loss
        if self.loss_fn.loss_type == "dapo":  # undo Lightning's / accumulate and DDP's mean over ranks
            loss = loss * self.trainer.accumulate_grad_batches * self.trainer.world_size
        b = len(batch)
        metrics = {
            "train/loss": loss.detach(),
            "train/kl": out.kl_mean,
            "train/clip_ratio": out.clip_ratio,
            "train/clip_ratio_low": out.clip_ratio_low,
            "train/clip_ratio_high": out.clip_ratio_high,
        }
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)  # mean over ranks
        if batch.old_logprobs is None:  # no update yet this round: generator and trainer score the same policy
            self.log_logp_diff(logp.detach(), batch)
        return loss

    def log_logp_diff(self, logp: Tensor, batch: RolloutBatch) -> None:  # logp [B, C]
        mask = batch.sequence_mask  # [B, C]
        diff = (logp - batch.gen_logprobs).abs() * mask
        n = mask.sum().clamp(min=1)
        self.log(
            "rollout/logp_diff_mean",
            diff.sum() / n,
            on_step=False,
            on_epoch=True,
            batch_size=len(batch),
            sync_dist=True,
        )
        self.log(
            "rollout/logp_diff_max",
            diff.max(),
            on_step=False,
            on_epoch=True,
            reduce_fx="max",
            batch_size=len(batch),
            sync_dist=True,
        )

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
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
                "of the last finite step. Lower optim.optimizer.lr or check the reward, then resume."
            )
            self.trainer.should_stop = True

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
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("grpo_lightning", {})
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)


def grad_norm(grads: list[Tensor]) -> float:
    """Global L2 norm of the gradients (inf/nan when any entry is); 0.0 when there are none."""
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
