"""`build`: Hydra's `instantiate`, with every config mistake turned into one line naming the config key."""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


def build(node: DictConfig, **kwargs):
    """`instantiate`, with every config mistake turned into a ValueError that names the config key.

    Objects the run built (a model, a settings dataclass) go to the partial this returns with `_partial_=True`,
    never through `kwargs`: Hydra merges kwargs into the config and would turn a dataclass into a config node.

    A constructor's own ValueError already names its key and passes through; an unknown `_target_`, an unknown
    or wrongly typed argument gets the node's key prefixed.
    """
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            raise cause from None
        key = node._get_full_key(None) or "<config>"
        if isinstance(cause, TypeError):
            raise ValueError(f"{key}: {cause} (check the keys and values under {key})") from None
        if "Error locating target" in str(err):
            raise ValueError(f"{key}._target_: cannot import {node.get('_target_')!r}") from None
        if isinstance(cause, Exception):  # e.g. Lightning's MisconfigurationException for a trainer setting
            raise ValueError(f"{key}: {first_line(cause)} (check the keys and values under {key})") from None
        raise


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
