"""Keep a run's console to what its user acts on: third-party tips and notices about other libraries' calls go.

Lightning prints advertising tips (litlogger, litmodels) at every `Trainer`; peft reads a transformers property
that transformers has deprecated, and Lightning calls a torch pytree API that torch has deprecated. None of them
is something a user of this application can change, so they are filtered by their exact text, as is Lightning's
notice about modules in eval mode (the frozen reference is, by design); every other warning and log line passes
through. With logger=mlflow (docs/tracking.md): MLflow's SQL store calls a SQLAlchemy 2.1 API that SQLAlchemy has
deprecated, and Lightning announces the experiment it creates in every fresh run directory's store.
"""

from __future__ import annotations

import logging
import warnings

_RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)
_DEPRECATIONS = (
    r"`is_gradient_checkpointing` is deprecated",  # peft's getattr on a transformers model
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # lightning.pytorch.utilities._pytree on torch >= 2.10
)
_SQLALCHEMY = r"The ``noload`` loader strategy is deprecated"  # mlflow's sqlalchemy_store on SQLAlchemy >= 2.1


_INTENDED = (
    # the frozen reference policy (and dropout-free LoRA layers) stay in eval mode on purpose while training
    r"Found \d+ module\(s\) in eval mode at the start of training",
)


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


class _DropNewExperiment(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Experiment with name ") and str(record.msg).endswith("Creating it."))


def quiet_third_party() -> None:
    """Install the filters (idempotent)."""
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    for message in _DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    warnings.filterwarnings("ignore", message=_SQLALCHEMY, category=DeprecationWarning)
    mlflow_logger = logging.getLogger("lightning.pytorch.loggers.mlflow")
    if not any(isinstance(f, _DropNewExperiment) for f in mlflow_logger.filters):
        mlflow_logger.addFilter(_DropNewExperiment())
    for message in _INTENDED:
        warnings.filterwarnings("ignore", message=message)
