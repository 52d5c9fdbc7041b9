"""Hydra's compose, each distinct defaults list once per test process; every caller gets a copy of its own.

Composing the config costs about 0.1-0.2 s (Hydra builds the defaults tree from ~30 YAML files and merges them);
copying a composed config costs a few ms. `install()` (tests/conftest.py, before any test module is imported)
replaces `hydra.compose`, so the tests' own composes (`make_cfg`, the in-process `cli()` of
tests/test_bad_input.py) and the package's (`config_docs/reference.py`, `studies/jobs.compose`, the benchmarks) alike
go through it.

How: Hydra composes in two steps. The overrides that choose config group options (`model=tiny`, `loss=dapo`,
`logger=[tensorboard,csv]`) decide the defaults list, which is composed into a config; the other overrides
(`generator.max_new_tokens=8`, `+reward.terms.x._target_=...`, `~reward.terms.gsm8k`) are then applied to it, in
order, by `ConfigLoaderImpl._apply_overrides_to_config`. Here the first step is done once per distinct list of
group choices (a real `compose` with those overrides alone, kept), and the second step by Hydra's own function
on a copy of it, the list split as Hydra splits it (`defaults_list.Overrides`). A mistake in either step raises
the error Hydra raises. With `return_hydra_config=True` (Hydra's node records every override) the whole
override list is the key.

Kept between processes too: a composition (the first step's, without Hydra's node) is pickled under
`.pytest_cache/compose/`, named by a hash of everything it depends on (every file under `conf/`, Hydra's and
OmegaConf's versions, the config name and the group choices), so the other `pytest -n` worker and later runs load
it (about 3 ms) instead of composing it; a change to any config file names new entries. The first `make check`
after a change composes as before; `pytest --cache-clear` empties the folder.

Composed every time, as without the cache: a compose over any search path but the package's own `conf/` (a
test's copy of the config, `hydra.searchpath=...`), an override of Hydra's own node, a sweep, a compose that
fails in its first step. `GRPO_LIGHTNING_TEST_COMPOSE_CACHE=0` turns the cache off, `=memory` keeps it in the
process only; `=check` composes each config both ways (the cached way through the folder) and fails on any
difference (config, flags, or the error raised).
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

_real_compose = hydra.compose
_cache: dict[tuple[Any, ...], DictConfig] = {}
_stats = {"hits": 0, "misses": 0, "loaded": 0, "uncached": 0}
_disk: dict[str, Any] = {"folder": None, "conf_dir": None, "digest": None}  # set by install(); digest on first use


def _conf_digest(conf_dir: str) -> str:
    """A hash of what a composition over `conf_dir` depends on: every file's path and bytes, Hydra's and
    OmegaConf's versions."""
    import omegaconf

    digest = hashlib.sha256(f"hydra {hydra.__version__} omegaconf {omegaconf.__version__}".encode())
    root = Path(conf_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _disk_path(key: tuple[Any, ...]) -> Path | None:
    folder = _disk["folder"]
    if folder is None:
        return None
    if _disk["digest"] is None:
        _disk["digest"] = _conf_digest(_disk["conf_dir"])
    name = hashlib.sha256(repr((_disk["digest"], key)).encode()).hexdigest()[:40]
    return folder / f"{name}.pkl"


def _load(path: Path | None) -> DictConfig | None:
    if path is None or not path.is_file():
        return None
    try:
        return pickle.loads(path.read_bytes())  # noqa: S301 - written by _store, below this checkout's .pytest_cache
    except Exception:  # noqa: BLE001 - a torn or foreign file: composed again, and written anew
        return None


def _store(path: Path | None, cfg: DictConfig) -> None:
    """Written whole or not at all (a temporary file renamed), so a worker never loads half a file."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_bytes(pickle.dumps(cfg))
    os.replace(temporary, path)


def _search_path() -> tuple[tuple[str | None, str | None], ...]:
    loader = GlobalHydra.instance().hydra.config_loader
    entries = loader.get_search_path().get_path()
    return tuple((e.provider, os.path.realpath(e.path) if e.provider == "main" else e.path) for e in entries)


def _cacheable(conf_dir: str, overrides: list[str]) -> bool:
    if not GlobalHydra().is_initialized():
        return False  # the real compose raises its own error
    own = (("hydra", "pkg://hydra.conf"), ("main", os.path.realpath(conf_dir)), ("schema", "structured://"))
    return _search_path() == own and not any("searchpath" in o for o in overrides)


def _split(overrides: list[str]) -> tuple[list[str], list[Any]] | None:
    """(the overrides that choose group options, the parsed overrides applied to the composed config), split as
    Hydra splits them; None where Hydra's own compose should see the list (a sweep, Hydra's node, a mistake)."""
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra._internal.defaults_list import Overrides
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
        if any(o.is_sweep_override() for o in parsed):
            return None
        repo = CachingConfigRepository(GlobalHydra.instance().hydra.config_loader.repository)
        applied = Overrides(repo, parsed).config_overrides
    except Exception:  # noqa: BLE001 - Hydra's compose raises it again, as the user sees it
        return None
    if any(o.key_or_group == "hydra" or o.key_or_group.startswith(("hydra.", "hydra/")) for o in applied):
        return None
    choices = [o.input_line for o in parsed if not any(o is a for a in applied)]
    return choices, applied


def _apply(applied: list[Any], cfg: DictConfig) -> None:
    """Hydra's second step, with the error `ConfigLoaderImpl.load_configuration` raises for a failure in it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    try:
        ConfigLoaderImpl._apply_overrides_to_config(applied, cfg)
    except OmegaConfBaseException as e:
        raise ConfigCompositionException().with_traceback(sys.exc_info()[2]) from e


def _composed(config_name, overrides: list[str], return_hydra_config: bool) -> DictConfig:
    """A copy of the stored composition of `overrides` (composed and stored on its first call)."""
    from hydra import version
    from hydra.core.utils import JobRuntime

    key: tuple[Any, ...] = (config_name, tuple(overrides), return_hydra_config, version.getbase())
    if return_hydra_config:  # Hydra's node records the working directory and the job's name at compose time
        key += (os.getcwd(), JobRuntime.instance().get("name"))
    if key in _cache:
        _stats["hits"] += 1
        return copy.deepcopy(_cache[key])
    path = None if return_hydra_config else _disk_path(key)  # Hydra's node holds this process's cwd and job
    cfg = _load(path)
    if cfg is not None:
        _stats["loaded"] += 1
    else:
        _stats["misses"] += 1
        cfg = _real_compose(config_name, overrides, return_hydra_config)
        _store(path, cfg)
    _cache[key] = cfg
    return copy.deepcopy(cfg)


def cached_compose(config_name, overrides: list[str], return_hydra_config: bool) -> DictConfig | None:
    """The composition from the cache, or None where it is not cached (the caller composes)."""
    if not return_hydra_config:
        split = _split(overrides)
        if split is None:
            return None
        choices, applied = split
        cfg = _composed(config_name, choices, False)
        _apply(applied, cfg)
        return cfg
    return _composed(config_name, overrides, True)


def _outcome(fn) -> tuple[str, Any, Any]:
    """("config", what is compared, the config) / ("error", what is compared, the error) / ("uncached", ...)."""
    try:
        cfg = fn()
    except Exception as e:  # noqa: BLE001 - compared, then raised again
        return "error", (type(e), str(e), type(e.__cause__), str(e.__cause__)), e
    if cfg is None:
        return "uncached", None, None
    flags = {name: cfg._get_flag(name) for name in ("struct", "readonly")}
    return "config", (OmegaConf.to_yaml(cfg), flags, list(cfg.keys())), cfg


def install(conf_dir: str) -> None:
    """Make `hydra.compose` the cached compose for compositions over `conf_dir` (the package's `conf/`)."""
    mode = os.environ.get("GRPO_LIGHTNING_TEST_COMPOSE_CACHE", "1")
    if mode == "0":
        return
    if mode != "memory":
        _disk.update(folder=Path(conf_dir).resolve().parents[1] / ".pytest_cache" / "compose", conf_dir=conf_dir)

    def compose(
        config_name: str | None = None,
        overrides: list[str] | None = None,
        return_hydra_config: bool = False,
        strict: bool | None = None,
    ) -> DictConfig:
        overrides = list(overrides or [])
        if strict is not None or not _cacheable(conf_dir, overrides):
            _stats["uncached"] += 1
            return _real_compose(config_name, overrides, return_hydra_config, strict)
        if mode == "check":
            real = _outcome(lambda: _real_compose(config_name, overrides, return_hydra_config))
            mine = _outcome(lambda: cached_compose(config_name, overrides, return_hydra_config))
            if mine[0] != "uncached":
                assert mine[:2] == real[:2], (
                    f"the compose cache differs from Hydra for {overrides}: {mine[1]} != {real[1]}"
                )
            if real[0] == "error":
                raise real[2]
            return real[2]
        cfg = cached_compose(config_name, overrides, return_hydra_config)
        if cfg is None:
            _stats["uncached"] += 1
            return _real_compose(config_name, overrides, return_hydra_config)
        return cfg

    compose.__doc__ = _real_compose.__doc__
    hydra.compose = compose


def stats() -> dict[str, int]:
    """Hits, misses (composed and stored), loaded (from the folder) and uncached composes so far in this
    process."""
    return dict(_stats)
