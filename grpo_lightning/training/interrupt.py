"""Ctrl-C and SIGTERM: finish the round, save a checkpoint, stop; a second Ctrl-C stops at once.

Why at the end of the round rather than immediately: a checkpoint taken mid-round would hold half-accumulated
gradients and a partly consumed round, which cannot be resumed exactly. Stopping at the round boundary costs at
most one round and the resumed run continues bit for bit. The second signal raises KeyboardInterrupt
(Lightning shuts down; the previous round's `last.ckpt` is intact), for when waiting is not an option: e.g. a
scheduler's SIGKILL after SIGTERM arrives sooner than the round ends.

Under DDP every rank calls `reduce_boolean_decision` at each round end, so a signal seen by any rank stops all.
"""

from __future__ import annotations

import signal
import sys
import threading

import lightning as L


class GracefulStop(L.Callback):
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopped_after_round: int | None = None
        self._previous: dict[int, object] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (which would stop mid-round); main thread only.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            self._restore()
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name} received: finishing this round, saving a checkpoint, then stopping "
            "(Ctrl-C again to stop now and lose the round)",
            file=sys.stderr,
            flush=True,
        )

    def after_round(self, trainer: L.Trainer) -> None:
        """Called by the rollout loop at the end of every round, before it samples the next one."""
        if trainer.strategy.reduce_boolean_decision(self.signum is not None, all=False):
            self.signum = self.signum or signal.SIGTERM
            self.stopped_after_round = trainer.current_epoch
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
