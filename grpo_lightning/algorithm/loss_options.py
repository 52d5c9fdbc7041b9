"""The loss node against its loss type (`loss_types.py`): another type's options and the values a type runs with
only, refused in one line naming the keys; never adjusted.

A preset (`loss=<type>`, conf/loss/) states what its type runs with: its options node (`loss.sapo`) and the values
of shared keys that the type needs (`LossType.requires`: VESPO without the separate rollout correction). Changing
`loss.loss_type` on another preset keeps that preset's values, and setting another type's options (`loss=grpo
+loss.sapo.temperature_pos=2`) configures nothing that runs; both are refused, naming the preset to choose instead.
The config check reads the composed node (`config_problems`, before anything is built), a direct construction the
object (`check_options` and the type's own `check`), with the same words.

Pure: imports only the standard library and the loss types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from grpo_lightning.algorithm.loss_types import LossType, LossTypeOptions, loss_type, loss_type_problem

ABSENT = object()


def check_options(loss: Any, kind: LossType) -> None:
    """Refuse another type's options (a `LossTypeOptions` field of `loss`) set away from their defaults: what
    `config_problems` says of a config node, for a direct construction (which cannot tell a default given)."""
    for field in fields(LossTypeOptions):
        if field.name != kind.options and not same_options(getattr(loss, field.name), field.default_factory()):
            raise ValueError(options_problem(field.name, kind.name, from_preset=False))


def same_options(value: Any, default: Any) -> bool:
    """Whether an options node (a settings object, or the mapping a config gives) holds the declared defaults."""
    if isinstance(value, Mapping):
        return all(getattr(default, str(key), ABSENT) == item for key, item in value.items() if str(key)[:1] != "_")
    return value == default


def options_problem(option: str, selected: str, from_preset: bool) -> str:
    """The line refusing the node `loss.<option>` under `loss.loss_type=<selected>`; `from_preset`: the node came
    with the preset `loss=<option>` (it names its `_target_`), so `loss.loss_type` was changed after a preset."""
    head = f"loss.{option}: options of loss_type {option}, but loss.loss_type is {selected}"
    if from_preset and loss_type(selected).name == selected:  # a registered type: its preset is loss=<name>
        return (
            f"{head}: choose the preset of {selected}, loss={selected}, rather than changing loss.loss_type after "
            f"loss={option} (each preset sets what its type runs with), or remove loss.{option}"
        )
    return f"{head}: remove loss.{option} or set loss.loss_type={option}"


def config_problems(node: Mapping[str, Any]) -> list[str]:
    """What the composed `loss` node holds that its loss type does not run with: another type's options node
    (`loss.sapo` under `loss_type: grpo`) and values other than its `requires` (`GRPOLoss.check_config`)."""
    name = node.get("loss_type")
    if loss_type_problem(name) is not None:
        return []  # the key's own rule names it
    kind, found = loss_type(name), []
    for field in fields(LossTypeOptions):
        child = node.get(field.name)
        if field.name != kind.options and isinstance(child, Mapping):
            found.append(options_problem(field.name, name, from_preset="_target_" in child))
    for key, (needed, _) in kind.requires.items():
        value: Any = node
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if not (type(value) is type(needed) and value == needed):
            found.append(kind.requirement_problem(key, value))
    return found
