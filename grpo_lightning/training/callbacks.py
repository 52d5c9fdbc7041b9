"""Small Lightning callbacks that are not rollouts or probes."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from grpo_lightning.sharding import save_policy

log = logging.getLogger(__name__)


class SavePolicy(L.Callback):
    """At the end of training, save the policy with `save_pretrained` (rank 0 writes).

    With LoRA this writes a PEFT adapter folder, loadable with `PeftModel.from_pretrained(base, folder)`;
    with full fine-tuning, a complete model folder. The tokenizer is saved beside it.
    """

    def __init__(self, directory: str | Path, tokenizer) -> None:
        """`tokenizer` is the run's (passed by the run, conf/callbacks/default.yaml)."""
        self.directory = Path(directory)
        self.tokenizer = tokenizer

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.diverged:  # never save blown-up weights (every rank knows it)
            return
        # trainer=fsdp: every process takes part in gathering the tensors rank 0 writes
        save_policy(pl_module.policy, self.directory, write=trainer.is_global_zero)
        if not trainer.is_global_zero:
            return
        self.tokenizer.save_pretrained(self.directory)
        log.info("policy saved to %s", self.directory)


def progress_bar(enabled: bool) -> RichProgressBar | None:
    """Lightning's Rich progress bar (it shows the round's reward), or none: Lightning refuses a progress-bar
    callback when `trainer.enable_progress_bar` is false, so the entry builds nothing then."""
    return RichProgressBar() if enabled else None
