"""The composed config walked against the declared keys (schema.py): each key's rule, and the keys nothing takes.

A node's keys are declared by the settings of its `_target_` (`schemas_of`), or, without one, by the node above
it (`nested_schema`); the top level by the run's own settings, which the caller passes (app/validation.py: the
config check, with `RunSettings`). `node_problems` walks the config once for the rules (`problems`) or, with
`unknown`, for the keys that nothing takes, each named with the closest key that exists. Also here, for the
checks across components: `configured_targets` (the `ConfigRules` classes a config names) and `lookup`.

Its layer is just above schema.py (the import contract in pyproject.toml), below every layer that declares keys:
it imports nothing of the package but the schema.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_lightning.schema import (
    ConfigRules,
    declared,
    import_target,
    nested_schema,
    problems,
    schemas_of,
    target_class,
)

ABSENT = object()
WIRED = re.compile(r"\$\{[\w.]+\}")
"""An interpolation that only refers to another key (`${generator.max_new_tokens}`), not a resolver's."""
MoreKeys = Callable[[str], Iterable[str]]
"""Keys a node at a dotted path holds beside what its declarations say (a reward term's pipeline keys)."""


def no_more_keys(path: str) -> Iterable[str]:
    return ()


def lookup(cfg: DictConfig, key: str):
    """The value at a dotted key, ABSENT when the key (or a parent) is not in the config or is `???`."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node or OmegaConf.is_missing(node, part):
            return ABSENT
        node = node[part]
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def node_problems(
    node: DictConfig, path: str, schemas: tuple[type, ...], unknown: bool = False, more_keys: MoreKeys = no_more_keys
) -> list[str]:
    """The problems of one node (at dotted `path`) and of the nodes below it, `schemas` declaring its keys unless
    its own `_target_` names a declaration: the declared keys' rules, or with `unknown` the keys nothing takes
    (`more_keys(path)`: the keys a node holds beside its declarations)."""
    target = node.get("_target_") if "_target_" in node else None
    if isinstance(target, str):
        schemas = target_schemas(target) or schemas
    values, children = {}, {}
    mappings = values_with_mappings(schemas)  # a mapping-valued key (engine_kwargs): its rule checks it
    for key in node:
        if not isinstance(key, str) or key.startswith("_") or OmegaConf.is_missing(node, key):
            continue
        try:
            value = node[key]
        except OmegaConfBaseException:  # an interpolation that resolves only in a Hydra run (${hydra:...})
            continue
        if OmegaConf.is_interpolation(node, key) and WIRED.fullmatch(str(node._get_node(key)._value())):
            continue  # a node or a key wired from elsewhere (loss.max_completion_length: ${generator.max_new_tokens}):
            # checked, and named, where it is written
        if isinstance(value, DictConfig) and key not in mappings:
            children[key] = value
        else:
            values[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    if unknown:
        found = unknown_keys(node, path, schemas, target, set(more_keys(path)))
    else:
        found = [problem for schema in schemas for problem in problems(values, schema, path)]
    for key, child in children.items():
        child_path = f"{path}.{key}" if path else key
        child_schemas = tuple(s for s in [nested_schema(schemas, key)] if s)
        found += node_problems(child, child_path, child_schemas, unknown, more_keys)
    return found


def unknown_keys(
    node: DictConfig, path: str, schemas: tuple[type, ...], target: Any, more: set[str] | None = None
) -> list[str]:
    """Keys of `node` that nothing takes, each named with the closest key that exists (`+model.lora.rank=4`: did
    you mean model.lora.r?), before anything is built: the keys a node's `_target_` accepts (its parameters, or
    its declared settings when it takes `**keys`), the declared keys of a node without one, `more`, and at the top
    level the run's own keys and nodes. A target that passes unknown keys on (`**kwargs`, undeclared) accepts any."""
    known = accepted_keys(path, schemas, target, more or set())
    if known is None:
        return []
    found = []
    for key in node:
        if not isinstance(key, str) or key.startswith("_") or key in known:
            continue
        child = node._get_node(key)
        if path and isinstance(child, DictConfig) and "_target_" in child:  # a component of its own, built by it
            continue
        where = f"{path}.{key}" if path else key
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {path + '.' if path else ''}{close[0]}?"
        else:
            shown = sorted(known)
            hint = f" (it takes {', '.join(shown[:10])}{', ...' if len(shown) > 10 else ''})" if path else ""
        found.append(f"{where} is not a key of {path or 'the config'}{hint}")
    return found


def accepted_keys(path: str, schemas: tuple[type, ...], target: Any, more: set[str] | None = None) -> set[str] | None:
    """The keys `node` may hold (see `unknown_keys`); None when any key is accepted."""
    names = {name for schema in schemas for name in declared(schema)} | (more or set())
    if not path:
        return names | top_level_nodes()
    if isinstance(target, str):
        built = import_target(target)
        if built is None:
            return None  # build() names the target that does not import
        try:
            parameters = inspect.signature(built).parameters.values()
        except (TypeError, ValueError):
            return None
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        if takes_any and not names:
            return None
        return names | {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return names or None


@functools.cache
def top_level_nodes() -> frozenset[str]:
    """The top-level nodes a run's config may hold: conf/config.yaml's own keys, its config groups, Hydra's."""
    conf = Path(__file__).resolve().parent / "conf"
    own = OmegaConf.load(conf / "config.yaml")
    groups = {p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    return frozenset({str(k) for k in own} | groups | {"hydra"})


def values_with_mappings(schemas: tuple[type, ...]) -> set[str]:
    """Keys declared with a mapping rule (`mapping_of`): their value is a node, checked as one value."""
    return {
        name
        for schema in schemas
        for name, f in declared(schema).items()
        if getattr(f.metadata["rule"], "takes_mapping", False)
    }


def target_schemas(target: str) -> tuple[type, ...]:
    """The settings declaring a `_target_`'s keys; () when the target does not import (build() reports it)."""
    found = import_target(target)
    return schemas_of(found) if found is not None else ()


def configured_targets(node: DictConfig) -> list[type[ConfigRules]]:
    """The classes with rules across the config (`ConfigRules`) that the `_target_`s of `node` and the nodes below
    it name, in config order, once each (a node wired from elsewhere, `${data.dataset}`, counts where written)."""
    found: list[type[ConfigRules]] = []
    target = target_class(node.get("_target_")) if "_target_" in node else None
    if target is not None and issubclass(target, ConfigRules):
        found.append(target)
    for key in node:
        if not isinstance(key, str) or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        try:
            child = node[key]
        except OmegaConfBaseException:  # an interpolation that resolves only in a Hydra run (${hydra:...})
            continue
        if isinstance(child, DictConfig):
            found += [cls for cls in configured_targets(child) if cls not in found]
    return found
