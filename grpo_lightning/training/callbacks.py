"""Small Lightning callbacks that are not rollouts or probes."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

log = logging.getLogger(__name__)


class SavePolicy(L.Callback):
    """At the end of training, save the policy with `save_pretrained` (rank 0 only).

    With LoRA this writes a PEFT adapter folder, loadable with `PeftModel.from_pretrained(base, folder)`;
    with full fine-tuning, a complete model folder. The tokenizer is saved beside it.
    """

    def __init__(self, directory: str | Path, tokenizer) -> None:
        """`tokenizer` is the run's (passed by the run, conf/callbacks/default.yaml)."""
        self.directory = Path(directory)
        self.tokenizer = tokenizer

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or pl_module.diverged:  # never save blown-up weights
            return
        pl_module.policy.save_pretrained(self.directory)
        self.tokenizer.save_pretrained(self.directory)
        log.info("policy saved to %s", self.directory)


def progress_bar(enabled: bool) -> RichProgressBar | None:
    """Lightning's Rich progress bar (it shows the round's reward), or none: Lightning refuses a progress-bar
    callback when `trainer.enable_progress_bar` is false, so the entry builds nothing then."""
    return RichProgressBar() if enabled else None
