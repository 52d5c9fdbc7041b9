"""The config check, run before any data or model is loaded: every declared key, then what spans several keys,
files or the platform.

Each key's type and range is declared once, in the settings dataclass of what it configures
(grpo_lightning/schema.py); `check_rules` walks the composed config and checks every declared key, so a mistake
fails in a second with a message naming the key rather than minutes later, deep inside a constructor, a model
load or a training step. What is left here spans more than one key: combinations (the temperature against half
precision, STORPO's step range, a data path and its test split), the platform (vLLM's build, CUDA, the trainer's
devices), files (data files' encodings, the cache and output directories) and resuming. Each failure is a
ValueError whose message names the config key and what to do (the CLI prints it as one line; several mistakes are
joined with "; "). Values that are legal but probably not meant (a near-zero temperature) get a warning instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class, get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_lightning.app.schema import RunSettings
from grpo_lightning.data.gsm8k import INSTALL_DATASETS, disk_splits, has_splits, path_format
from grpo_lightning.generation.base import LOW_TEMPERATURE, MIN_TEMPERATURE
from grpo_lightning.generation.placement import world_size
from grpo_lightning.rewards.pipeline import check_moved_keys
from grpo_lightning.schema import declared, nested_schema, problems, schemas_of
from grpo_lightning.training.overlap import optimizer_steps_per_round, staleness_problem
from grpo_lightning.training.tracking import writer_for

log = logging.getLogger(__name__)

ABSENT = object()


# ---- every declared key ------------------------------------------------------------------------------------------
def lookup(cfg: DictConfig, key: str):
    """The value at a dotted key, ABSENT when the key (or a parent) is not in the config or is `???`."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node or OmegaConf.is_missing(node, part):
            return ABSENT
        node = node[part]
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def check_rules(cfg: DictConfig) -> list[str]:
    """Every declared key of the composed config against its rule (grpo_lightning/schema.py): the top level and
    third-party nodes by `RunSettings` (app/schema.py), every node with a `_target_` by its target's settings. A
    key no declaration knows is left to the constructor it is passed to (build() names it)."""
    return node_problems(cfg, "", (RunSettings,))


def node_problems(node: DictConfig, path: str, schemas: tuple[type, ...]) -> list[str]:
    """The problems of one node (at dotted `path`) and of the nodes below it, `schemas` declaring its keys unless
    its own `_target_` names a declaration."""
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
        if isinstance(value, DictConfig) and OmegaConf.is_interpolation(node, key):
            continue  # a whole node wired from elsewhere (eval.dataset.train: ${data.dataset}): checked there
        if isinstance(value, DictConfig) and key not in mappings:
            children[key] = value
        else:
            values[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    found = [problem for schema in schemas for problem in problems(values, schema, path)]
    for key, child in children.items():
        child_path = f"{path}.{key}" if path else key
        found += node_problems(child, child_path, tuple(s for s in [nested_schema(schemas, key)] if s))
    return found


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
    try:
        return schemas_of(get_object(target))
    except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
        return ()


# ---- the checks --------------------------------------------------------------------------------------------------
def validate(cfg: DictConfig, platform: bool = True) -> None:
    """Check every key's type and range, then the combinations, before anything is loaded (each error names
    its key; all of them are reported at once). `platform=False` leaves out what this machine must have (vLLM, a
    GPU: `check_platform`), for a dry run that prints a GPU recipe's plan on a machine without them first."""
    check_moved_keys(cfg)  # reward.format_bonus, loss.scale_rewards: a one-line message naming the new key
    if "dataset" not in cfg.data:
        raise ValueError(
            "data=rounds is the shape of a round every data source shares (data/rounds.yaml), not a source: choose "
            "data=gsm8k or data=reasoning_gym"
        )
    if "_target_" not in cfg.generator:
        raise ValueError(
            "generator=sampling is the sampling every engine shares (generator/sampling.yaml), not an engine: choose "
            "generator=hf or generator=vllm"
        )
    found = check_rules(cfg)
    if found:
        raise ValueError("; ".join(found))
    check_combinations(cfg)
    check_overlap(cfg)
    check_reward_fits_data(cfg)
    check_selfplay(cfg)
    target = cfg.optim.optimizer.get("_target_")
    try:
        get_class(target)
    except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
        raise ValueError(f"optim.optimizer._target_: cannot import {target!r}") from None
    if platform:
        check_platform(cfg)
    check_logger_packages(cfg)
    check_data_files(cfg)
    check_cache_dir(cfg.paths.cache_dir)
    check_writable(Path(cfg.paths.output_dir))
    check_fresh_or_resume(cfg)


def check_platform(cfg: DictConfig) -> None:
    """What this machine must have for the run: a GPU where the trainer asks for one (what an engine needs is its
    own `check_platform`: generation/vllm.py)."""
    check_accelerator(cfg)


def check_combinations(cfg: DictConfig) -> None:
    """Values fine one by one that do not go together, or that are legal but probably a mistake (a warning)."""
    temperature = cfg.generator.temperature
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"generator.temperature={temperature!r} is below {MIN_TEMPERATURE}: logits / temperature overflow in "
            "half precision and every group samples one and the same completion (greedy decoding); use a "
            "temperature near 1 for GRPO"
        )
    if temperature < LOW_TEMPERATURE:
        log.warning(
            "generator.temperature=%s is very low: the G samples of a group will be nearly identical, so most "
            "advantages are 0 and rounds train little",
            temperature,
        )
    weights = lookup(cfg, "perf.generate.weights")
    accelerator = cfg.trainer.get("accelerator")
    if weights == "int8" and not is_vllm(cfg) and accelerator in ("gpu", "cuda", "mps"):
        raise ValueError(
            f"perf.generate.weights=int8 runs on the CPU only (torch's _weight_int8pack_mm CPU kernel) and "
            f"trainer.accelerator={accelerator} puts the policy the HF engine samples from there: use "
            "perf.generate.weights=bfloat16 or float32"
        )
    variant = cfg.get("variant") or {}
    if "min_steps" in variant and "max_steps" in variant and variant.max_steps < variant.min_steps:
        raise ValueError(f"variant.max_steps ({variant.max_steps}) must be >= variant.min_steps ({variant.min_steps})")
    dataset = cfg.data.dataset
    if dataset.get("source") == "path" and not dataset.path:
        raise ValueError("data.dataset.path must be set when data.dataset.source=path")
    if (
        cfg.eval.enabled
        and dataset.get("source") == "path"
        and not cfg.eval.dataset.path
        and not has_splits(Path(str(dataset.path)).expanduser())
    ):
        raise ValueError(
            "eval.dataset.path must be set when data.dataset.source=path (evaluation reads its test split): give "
            "the test split's file or save_to_disk folder, or turn evaluation off with eval.enabled=false"
        )


def check_logger_packages(cfg: DictConfig) -> None:
    """Each selected tracker's package is installed (its writer in training/tracking.py names it), decided from
    the import system without importing it; a `_target_` that does not import is build()'s to report."""
    for name, node in (cfg.get("logger") or {}).items():
        try:
            writer = writer_for(get_class(node.get("_target_")))
        except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
            continue
        package = writer.package if writer is not None else None
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"logger.{name} needs the {package} package: pip install 'grpo_lightning[{package}]' (from a "
                f"checkout: pip install -e '.[{package}]'), or leave {name} out of logger=[...]"
            )


def check_reward_fits_data(cfg: DictConfig) -> None:
    """A reward term that scores with the problem's record (`needs_record`, e.g. reward=reasoning_gym) needs a data
    source whose problems carry one (`gives_records`, data=reasoning_gym)."""
    source = target_class(cfg.data.dataset.get("_target_"))
    if source is None or getattr(source, "gives_records", False):
        return
    for name, spec in (cfg.reward.get("terms") or {}).items():
        term = target_class(spec.get("_target_")) if OmegaConf.is_dict(spec) else None
        if getattr(term, "needs_record", False):
            where = getattr(term, "record_source", "a data source whose problems carry records")
            raise ValueError(
                f"reward.terms.{name} ({term.__name__}) scores with each problem's record from {where}, which "
                f"data.dataset ({source.__name__}) does not give: use {where}, or another reward (reward=gsm8k)"
            )


def variant_name(variant: type | None) -> str:
    """`variant=<name>` of a variant class, or its class path when it is not a registered variant."""
    from grpo_lightning.variants.base import VARIANTS

    names = [name for name, cls in VARIANTS.items() if cls is variant]
    if names:
        return f"variant={names[0]}"
    return f"{variant.__module__}.{variant.__qualname__}" if variant is not None else "unknown"


def check_selfplay(cfg: DictConfig) -> None:
    """variant=selfplay and data=games go together, with the HF engine, a LoRA adapter (the snapshots are
    adapters), rounds that do not overlap, game reward terms and the evaluator that plays (docs/selfplay.md)."""
    from grpo_lightning.data.games import GameSeeds
    from grpo_lightning.games.base import make_game
    from grpo_lightning.rewards import games as game_rewards
    from grpo_lightning.training.game_evaluation import GameEvaluator
    from grpo_lightning.variants.selfplay import SelfPlay

    variant = target_class(cfg.variant.get("_target_"))
    source = target_class(cfg.data.dataset.get("_target_"))
    selfplay = variant is not None and issubclass(variant, SelfPlay)
    games = source is not None and issubclass(source, GameSeeds)
    if games and not selfplay:
        raise ValueError(
            f"data=games is played by variant=selfplay (this run's variant is {variant_name(variant)}): add "
            "variant=selfplay reward=selfplay"
        )
    if not selfplay:
        return
    if not games:
        raise ValueError(
            "variant=selfplay plays games: choose data=games (data.dataset.game=tictactoe or textarena:<id>)"
        )
    if is_vllm(cfg):
        raise ValueError(
            "variant=selfplay plays its opponents by swapping adapter weights in the HF engine, which generator=vllm "
            "cannot do yet: use generator=hf"
        )
    if lookup(cfg, "rollout.max_staleness") not in (0, ABSENT):
        raise ValueError(
            "variant=selfplay samples from the current policy and its snapshots: set rollout.max_staleness=0"
        )
    if not cfg.model.lora.enabled:
        raise ValueError("variant=selfplay keeps its opponents as LoRA snapshots: set model.lora.enabled=true")
    game = make_game(cfg.data.dataset.game)
    game.reset(0)
    eval_opponents = list(cfg.eval.get("opponents") or []) if cfg.eval.enabled else []
    for key, names in (("variant.fixed_opponents", cfg.variant.fixed_opponents), ("eval.opponents", eval_opponents)):
        if "perfect" in names and not game.solved:
            raise ValueError(f"{key}: 'perfect' plays solved games only (tictactoe), and {game.game_id} is not one")
        if "random" in names and not game.legal_moves():
            raise ValueError(
                f"{key}: 'random' plays a random legal move, and {cfg.data.dataset.game} does not list its legal "
                "moves here (docs/selfplay.md); leave it out"
            )
    for place in ("terms", "transforms"):
        for name, spec in (cfg.reward.get(place) or {}).items():
            stage = target_class(spec.get("_target_")) if OmegaConf.is_dict(spec) else None
            if getattr(stage, "needs_record", False) and stage.__module__ != game_rewards.__name__:
                raise ValueError(
                    f"reward.{place}.{name} ({stage.__name__}) scores another data source's records, not game turns: "
                    "use reward=selfplay"
                )
    evaluator = target_class(cfg.eval.get("_target_"))
    if cfg.eval.enabled and (evaluator is None or not issubclass(evaluator, GameEvaluator)):
        raise ValueError(
            "eval._target_ must be grpo_lightning.training.game_evaluation.GameEvaluator with data=games (games are "
            "evaluated by playing; experiment=selfplay_tictactoe sets it), or set eval.enabled=false"
        )


def target_class(target) -> type | None:
    """The class a `_target_` names; None when it names none (or does not import: build() reports that)."""
    try:
        obj = get_object(str(target))
    except Exception:  # noqa: BLE001 - hydra raises ImportError or ValueError depending on the path
        return None
    return obj if isinstance(obj, type) else None


def is_vllm(cfg: DictConfig) -> bool:
    """generator=vllm (the config group's engine, by its target)."""
    return str(cfg.generator.get("_target_", "")).endswith("VLLMGenerator")


def check_overlap(cfg: DictConfig) -> None:
    """rollout.max_staleness >= 1 (training/overlap.py): an engine and a strategy that can sample beside the
    trainer, and rounds that take no more optimizer steps than the bound, known from data.* and
    trainer.accumulate_grad_batches before anything loads."""
    bound = lookup(cfg, "rollout.max_staleness")
    if bound is ABSENT or not bound:
        return
    key = f"rollout.max_staleness={bound}"
    if not is_vllm(cfg) and not cfg.perf.generate.custom_decode:  # the vLLM engine's rules: VLLMGenerator.check_config
        raise ValueError(
            f"{key} needs perf.generate.custom_decode=true: HF generate draws from the global RNG, which the trainer's "
            "thread owns, and so cannot sample beside it"
        )
    if "fsdp" in str(cfg.trainer.get("strategy", "")).lower():
        raise ValueError(f"{key}: trainer=fsdp shards the weights the sampler would copy; use trainer=ddp or gpu")
    data, accumulate = cfg.data, cfg.trainer.get("accumulate_grad_batches")
    steps = optimizer_steps_per_round(
        data.prompts_per_round, data.groups_per_micro_batch, data.num_iterations, accumulate, world_size(cfg)
    )
    problem = staleness_problem(steps, bound) if steps is not None else None  # None: another check names it
    if problem is not None:
        raise ValueError(problem)


def check_accelerator(cfg: DictConfig) -> None:
    accelerator = cfg.trainer.get("accelerator")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator}: no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "train on the CPU with trainer=cpu"
        )


def check_data_files(cfg: DictConfig) -> None:
    """Each local data file or folder the run will read (data.dataset.source=path): present and of a known format
    (data/gsm8k.py reads it by its suffix); a JSONL file UTF-8 text (not compressed, not UTF-16); a DatasetDict
    folder holding the split it is read for. Its columns need the data read: the source checks them as it loads."""
    dataset = cfg.data.dataset
    if dataset.get("source") != "path":
        return
    files = [("data.dataset.path", dataset.path, dataset.split)]
    if cfg.eval.enabled:
        files.append(("eval.dataset.path", cfg.eval.dataset.path or dataset.path, "test"))
    for key, value, split in files:
        path = Path(str(value)).expanduser()
        kind = path_format(path, key)
        if kind == "jsonl":
            check_text_file(key, path)
        if kind != "jsonl" and importlib.util.find_spec("datasets") is None:
            raise ValueError(f"{key} ({kind}: {path.name}) needs `datasets`: {INSTALL_DATASETS}")
        splits = disk_splits(path) if has_splits(path) else None
        if splits is None or split in splits:
            continue
        if key == "data.dataset.path":
            raise ValueError(f"data.dataset.split {split!r} is not a split of {path}; splits: {', '.join(splits)}")
        raise ValueError(
            f"eval.dataset.path: {path} has no {split!r} split (splits: {', '.join(splits)}); give the test split's "
            "file or save_to_disk folder, or turn evaluation off with eval.enabled=false"
        )


def check_text_file(key: str, path: Path) -> None:
    if not path.exists():
        raise ValueError(f"{key}: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{key}: {path} is not a file (give a JSONL file)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path} ({err.strerror})") from None
    if data[:2] == b"\x1f\x8b":
        raise ValueError(f"{key}: {path} is gzip-compressed; decompress it first (gunzip -k {path.name})")
    bom = data[:2] in (b"\xff\xfe", b"\xfe\xff")
    ascii_utf16 = len(data) >= 4 and (data[1] == data[3] == 0 or data[0] == data[2] == 0) and b"\0\0" not in data[:4]
    if bom or ascii_utf16:
        raise ValueError(f"{key}: {path} is UTF-16 text; JSONL must be UTF-8 (iconv -f UTF-16 -t UTF-8)")
    if b"\0" in data[:65536]:
        raise ValueError(f"{key}: {path} is a binary file, not JSONL text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{key}: {path} is not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); save it as "
            "UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None


def check_cache_dir(value: str) -> None:
    """The converted-model cache: a directory, or one that can be created (it is shared by every run)."""
    directory = Path(str(value)).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"paths.cache_dir: {directory} is a file, not a directory; point paths.cache_dir elsewhere")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"paths.cache_dir: cannot create {directory} ({err.strerror}); set paths.cache_dir or the "
            "GRPO_LIGHTNING_CACHE environment variable to a writable directory"
        ) from None


def check_writable(directory: Path) -> None:
    """Fail before any work when the run could not save its checkpoints and logs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"paths.output_dir: cannot write to {directory} ({err.strerror}); choose another hydra.run.dir"
        ) from None


def check_fresh_or_resume(cfg: DictConfig) -> None:
    """A fresh run never writes into a directory that holds another run's checkpoints."""
    previous = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if cfg.get("ckpt_path") is None and previous.exists():
        raise ValueError(
            f"paths.output_dir {previous.parent.parent} already holds a run ({previous}); resume it with "
            "ckpt_path=last, or start a new run in another directory (hydra.run.dir)"
        )
