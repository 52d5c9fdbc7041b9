"""The two ways a run ends early on purpose; the CLI turns each into its exit code (grpo_lightning/__main__.py)."""

from __future__ import annotations


class RunInterrupted(Exception):
    """Raised by `Run.fit` after a graceful stop; the CLI exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class TrainingStopped(Exception):
    """The run stopped itself (non-finite or divergence guard); the CLI prints it and exits 1. `printed`: the
    process already printed it (a stop printed before the run's clean-up, which another process may cut short)."""

    printed: bool = False


class EngineFailed(TrainingStopped):
    """An inference engine or server failed at run time (killed, unanswering, its weights changed by another
    writer): one line, exit 1. `resumable`: whether resuming from the last checkpoint can succeed as things stand
    (a run that started its servers starts new ones; a server of one's own must be back first: the message says
    so); the run appends the resume command only then."""

    def __init__(self, message: str, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable
