"""Each config key declared once: its type, range (a rule) and default in a settings dataclass; its meaning in conf/.

A settings dataclass declares its keys with `setting(default, rule)`. The same declaration serves three readers:

- the component's constructor: a `Configured` class (a variant, an engine, the data module) takes the keys of its
  config node and builds its settings objects from them (`settings_from`), each of which checks itself, so a
  direct construction fails like a config run and no constructor re-lists a setting;
- the config check (app/validation.py), which checks a composed config node against the declaration of its
  `_target_` before anything is built or loaded, so a mistake fails in a second with one line naming the key,
  then asks each component for the rules that span its keys and other nodes (`ConfigRules.check_config`);
- docs/configuration.md, whose tables list the declared keys with their values in conf/.

A key's meaning is written once, where users set it: the comment on its line in grpo_lightning/conf/ (the reference
page is generated from those comments, config_docs/reference.py). The default config states the declared defaults
(tests/unit/test_schema.py fails where they differ).

`configures(cls, *schemas)` names the declarations of a class that is not ours (Lightning's loggers) or not a class
(a function target). A rule returns what the value must be ("must be an integer"), or None when it is fine. Rules
mirror the message format of every error the project prints: "<key> <what it must be> (got <value>)".
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

SEED_MAX = 2**32 - 1
"""numpy's limit on a seed, which Lightning's seed_everything applies (it replaces others at random)."""
Rule = Callable[[Any], str | None]
"""A check of one value: what the value must be ("must be an integer"), or None when it is fine."""

_SCHEMAS: dict[Callable, tuple[type, ...]] = {}


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, *, factory=None) -> Any:
    """A dataclass field carrying its rule (`factory`: a default built per instance, e.g. a dict)."""
    metadata = {"rule": rule}
    if factory is not None and dataclasses.is_dataclass(factory):
        metadata["schema"] = factory  # a nested node: its keys are the fields of this dataclass
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class ConfigRules:
    """A component's rules across the run's config: what its keys require of other nodes (`check_config`) and of the
    machine (`check_platform`). The config check calls both on every class a `_target_` of the composed config
    names that derives from this, before anything is built or loaded."""

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Rules between this component's keys and the rest of the run's composed config (`cfg`, an omegaconf
        DictConfig), raised as one ValueError naming the keys. None by default: each key's own rule is checked
        from its declaration."""

    @classmethod
    def check_platform(cls, cfg: Any) -> None:
        """What this machine must have for the component as `cfg` configures it (a package's build, a GPU), as one
        ValueError naming the keys; left out by a dry run that prints a GPU recipe's plan on a machine without
        one. None by default."""


class Configured(ConfigRules):
    """A component configured by settings dataclasses (`settings_types`): its config node's keys are their fields.

    Hydra calls the constructor with the node's keys; the constructor passes them to `settings_from`, which builds
    one settings object per type (each checks its own keys), so a setting is never re-listed as an argument. (A
    settings dataclass that is itself the component, a data source, derives from `ConfigRules` only.)
    """

    settings_types: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def settings_from(cls, keys: Mapping[str, Any]) -> tuple[Any, ...]:
        """One object of each of `settings_types` from a config node's keys (a key no type declares is a
        TypeError naming it, as an unknown keyword argument would be)."""
        names = [{f.name for f in dataclasses.fields(schema)} for schema in cls.settings_types]
        unknown = sorted(set(keys) - set().union(*names))
        if unknown:
            raise TypeError(f"{cls.__name__} got unexpected keys: {', '.join(unknown)}")
        return tuple(
            schema(**{k: plain(v) for k, v in keys.items() if k in declared_names})
            for schema, declared_names in zip(cls.settings_types, names, strict=True)
        )


def plain(value: Any) -> Any:
    """A config value as plain Python: Hydra passes a list or mapping key as an omegaconf container, which a rule
    (and a frozen settings object) should see as the list or dict it means."""
    if isinstance(value, Mapping) and not isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | list | tuple):
        return [plain(v) for v in value]
    return value


def settings_of(node: Mapping[str, Any], schema: type) -> Any:
    """The settings object of `schema` that a config node configures: the keys the node sets (nested settings
    built the same way), the declared defaults for the others, keys `schema` does not declare left to their own
    owners. For reading a validated config (app/validation.py checks every key first) where a component's
    settings are needed before the component is built: the memory estimate, the engine's checks."""
    values = {}
    for field in dataclasses.fields(schema):
        if field.name not in node:
            continue
        value, nested = node[field.name], field.metadata.get("schema")
        values[field.name] = settings_of(value, nested) if nested and isinstance(value, Mapping) else plain(value)
    return schema(**values)


def import_target(target: Any) -> Any:
    """What a config node's `_target_` names (a dotted path to a class or function); None when it names nothing
    that imports (the build reports that, with the key). Without Hydra, so that every layer may ask."""
    parts = str(target).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except (ImportError, ValueError):  # ValueError: an empty name ("", "a..b")
            continue
        for name in parts[cut:]:
            found = getattr(found, name, None)
        return found
    return None


def target_class(target: Any) -> type | None:
    """The class a `_target_` names; None when it names no class."""
    found = import_target(target)
    return found if isinstance(found, type) else None


def configures(cls: Callable, *schemas: type) -> None:
    """Declare that the keys of a config node whose `_target_` is `cls` (a class not ours, or a function) are the
    fields of `schemas`; a `Configured` class says so itself."""
    _SCHEMAS[cls] = schemas


def schemas_of(target: Any) -> tuple[type, ...]:
    """The settings dataclasses declaring the keys of `target`'s config node (itself, when it is one)."""
    if isinstance(target, type) and issubclass(target, Configured):
        return target.settings_types
    if target in _SCHEMAS:
        return _SCHEMAS[target]
    return (target,) if dataclasses.is_dataclass(target) else ()


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


def list_of_text(value) -> str | None:
    """A list of strings (possibly empty): URLs, command-line arguments."""
    ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    return None if ok else "must be a list of strings"


def made_directory(key: str, path: Path, if_file: str, if_uncreatable: str) -> Path:
    """The directory a path key names, made if missing: one line naming `key` when it is a file (`if_file`: what to
    do) or cannot be made (`if_uncreatable`), before anything loads."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{key}: {path} is a file, not a directory; {if_file}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{key}: cannot create {path} ({err.strerror}); {if_uncreatable}") from None
    return path
