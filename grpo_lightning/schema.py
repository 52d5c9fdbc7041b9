"""Each config key declared once: its type and range (a rule), its default and its meaning, in a settings dataclass.

A settings dataclass declares its keys with `setting(default, rule, "meaning")`. The same declaration serves three
readers:

- the object's constructor, which calls `check_settings(self)` (a direct construction fails like a config run);
- the config check (app/validation.py), which checks a composed config node against the declaration before
  anything is built or loaded, so a mistake fails in a second with one line naming the key;
- the reference page (docs/configuration.md, generated), which shows each key's meaning.

`configures(cls, *schemas)` names the declarations of a class that is not itself a settings dataclass (an engine
whose keys are its sampling and engine settings, or a third-party class such as Lightning's Trainer); a settings
dataclass configures itself. A rule returns what the value must be ("must be an integer"), or None when it is fine.
Rules mirror the message format of every error the project prints: "<key> <what it must be> (got <value>)".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

SEED_MAX = 2**32 - 1
"""numpy's limit on a seed, which Lightning's seed_everything applies (it replaces others at random)."""
Rule = Callable[[Any], str | None]
"""A check of one value: what the value must be ("must be an integer"), or None when it is fine."""

_SCHEMAS: dict[type, tuple[type, ...]] = {}


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, help: str = "", *, factory=None) -> Any:
    """A dataclass field carrying its rule and meaning (`factory`: a default built per instance, e.g. a dict)."""
    metadata = {"rule": rule, "help": help}
    if factory is not None and dataclasses.is_dataclass(factory):
        metadata["schema"] = factory  # a nested node: its keys are the fields of this dataclass
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def configures(cls: type, *schemas: type) -> None:
    """Declare that the keys of a config node whose `_target_` is `cls` are the fields of `schemas`."""
    _SCHEMAS[cls] = schemas


def schemas_of(cls: type) -> tuple[type, ...]:
    """The settings dataclasses declaring the keys of `cls`'s config node (itself, when it is one)."""
    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    return (cls,) if dataclasses.is_dataclass(cls) else ()


def declared(schema: type) -> dict[str, dataclasses.Field]:
    """The fields of a settings dataclass that carry a rule or a meaning, by name."""
    return {f.name: f for f in dataclasses.fields(schema) if "rule" in f.metadata}


def nested_schema(schemas: tuple[type, ...], key: str) -> type | None:
    """The settings dataclass of the node `key` below a node declared by `schemas` (None: undeclared)."""
    for schema in schemas:
        f = declared(schema).get(key)
        if f is not None and "schema" in f.metadata:
            return f.metadata["schema"]
    return None


def problems(values: Mapping[str, Any], schema: type, prefix: str) -> list[str]:
    """Every declared key present in `values` whose value breaks its rule, as '<prefix>.<key> <rule> (got v)'.

    When every key passes, a schema's own `joint_problems(values, prefix) -> list[str]` (a staticmethod, where
    declared) checks what spans several of its keys (a reasoning-gym task and that task's keys), so the config
    check and the constructor say the same there too.
    """
    found = []
    for name, f in declared(schema).items():
        rule = f.metadata["rule"]
        if rule is None or name not in values:
            continue
        problem = rule(values[name])
        if problem is not None:
            key = f"{prefix}.{name}" if prefix else name
            found.append(f"{key} {problem} (got {values[name]!r})")
    joint = getattr(schema, "joint_problems", None)
    if not found and joint is not None:
        found += joint(values, prefix)
    return found


def check_settings(instance: Any, prefix: str) -> None:
    """Raise one ValueError naming every key of `instance` that breaks its rule (called by `__post_init__`)."""
    values = {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
    found = problems(values, type(instance), prefix)
    if found:
        raise ValueError("; ".join(found))


# ---- rules -----------------------------------------------------------------------------------------------------------
def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Rule:
    def rule(value):
        if not is_int(value):
            return "must be an integer"
        if low is not None and value < low:
            return f"must be >= {low}"
        if high is not None and value > high:
            return f"must be <= {high}"
        return None

    return rule


def number(low: float | None = None, high: float | None = None, above: float | None = None,
           below: float | None = None) -> Rule:  # fmt: skip
    """A finite int or float in [low, high] and (above, below) where given."""

    def rule(value):
        if not is_number(value) or not math.isfinite(value):
            return "must be a finite number"
        for bound, ok, text in [
            (low, lambda b: value >= b, ">="),
            (above, lambda b: value > b, ">"),
            (high, lambda b: value <= b, "<="),
            (below, lambda b: value < b, "<"),
        ]:
            if bound is not None and not ok(bound):
                return f"must be {text} {bound}"
        return None

    return rule


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def text(value) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def choice(*options) -> Rule:
    def rule(value):
        return None if value in options else f"must be one of {', '.join(map(str, options))}"

    return rule


def optional(inner: Rule) -> Rule:
    def rule(value):
        if value is None:
            return None
        problem = inner(value)
        return None if problem is None else f"{problem} or null"

    return rule


def mapping_of(example: str) -> Rule:
    """A mapping-valued key (its value is a node, checked as one value); `example` shows one in the message."""

    def rule(value):
        return None if isinstance(value, Mapping) else f"must be a mapping, e.g. {example}"

    rule.takes_mapping = True
    return rule


mapping = mapping_of("{enforce_eager: true}")


def strings(value) -> str | None:
    ok = isinstance(value, str) or (
        isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value)
    )
    return None if ok else "must be a module name pattern or a list of module names"
