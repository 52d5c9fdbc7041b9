"""The two ways a run ends early on purpose; the CLI turns each into its exit code (grpo_lightning/__main__.py)."""

from __future__ import annotations


class RunInterrupted(Exception):
    """Raised by `Run.fit` after a graceful stop; the CLI exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class TrainingStopped(Exception):
    """The run stopped itself (non-finite or divergence guard); the CLI prints it and exits 1."""
