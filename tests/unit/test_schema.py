"""One declaration per key (grpo_lightning/schema.py): the config check finds every key a user can set.

Independent record: the keys the config check covered when it was a hand-written table, each set to a value no
rule accepts; the walk over the composed config must name every one of them. And the constructor of a settings
dataclass and the config check give one and the same message for one mistake.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from grpo_lightning.app.validation import check_rules
from grpo_lightning.schema import problems
from tests.conftest import make_cfg

KEYS = [
    "checkpoint.every_n_rounds",
    "checkpoint.last_every_n_rounds",
    "ckpt_path",
    "data.dynamic_sampling.enabled",
    "data.dynamic_sampling.max_extra_batches",
    "data.groups_per_micro_batch",
    "data.max_prompt_tokens",
    "data.num_iterations",
    "data.prompts_per_round",
    "data.seed",
    "dry_run",
    "eval.at_start",
    "eval.batch_size",
    "eval.dataset.path",
    "eval.dataset.num_problems",
    "eval.enabled",
    "eval.every_n_rounds",
    "eval.max_new_tokens",
    "eval.max_prompt_tokens",
    "eval.num_problems",
    "eval.num_samples_logged",
    "eval.pass_k",
    "eval.seed",
    "generator.batch_size",
    "generator.logp_diff_threshold",
    "generator.max_new_tokens",
    "generator.on_stale",
    "generator.seed_per_prefix",
    "generator.temperature",
    "generator.top_k",
    "generator.top_p",
    "guard.max_consecutive_skipped_steps",
    "guard.max_norm_growth",
    "logging.num_samples_logged",
    "logging.samples_every_n_rounds",
    "loss.beta",
    "loss.epsilon_high",
    "loss.epsilon_low",
    "loss.loss_type",
    "loss.max_completion_length",
    "model.dtype",
    "model.lora.alpha",
    "model.lora.dropout",
    "model.lora.enabled",
    "model.lora.r",
    "model.lora.target_modules",
    "model.trust_remote_code",
    "optim.optimizer.amsgrad",
    "optim.optimizer.betas",
    "optim.optimizer.eps",
    "optim.optimizer.lr",
    "optim.optimizer.weight_decay",
    "optim.schedule.kind",
    "optim.schedule.min_ratio",
    "optim.schedule.warmup_steps",
    "paths.cache_dir",
    "paths.output_dir",
    "perf.forward.fused_lora",
    "perf.forward.logits_chunk_tokens",
    "perf.forward.runs_by_length",
    "perf.forward.share_prefix",
    "perf.generate.custom_decode",
    "perf.generate.merge_lora",
    "perf.generate.packed_weights",
    "perf.generate.sampler",
    "perf.generate.share_prefill",
    "perf.generate.stream_logprobs",
    "rollout.max_staleness",
    "rollout.sampler_threads",
    "seed",
    "trainer.accelerator",
    "trainer.accumulate_grad_batches",
    "trainer.devices",
    "trainer.enable_model_summary",
    "trainer.enable_progress_bar",
    "trainer.gradient_clip_val",
    "trainer.log_every_n_steps",
    "trainer.max_epochs",
    "trainer.num_nodes",
    "trainer.precision",
    "data.dataset.source",
    "data.dataset.split",
    "data.dataset.path",
    "data.dataset.hub_id",
    "data.dataset.package",
    "data.dataset.system_prompt",
    "data.dataset.prompt_template",
]
OPTION_KEYS = {
    "generator=vllm": [
        "generator.device",
        "generator.dtype",
        "generator.enable_prefix_caching",
        "generator.enable_sleep_mode",
        "generator.engine_kwargs",
        "generator.gpu_memory_utilization",
        "generator.kv_cache_gib",
        "generator.logp_diff_threshold",
        "generator.lora_sync",
        "generator.max_model_len",
        "generator.model_path",
        "generator.on_stale",
        "generator.revision",
        "generator.seed",
        "generator.sleep_level",
        "generator.sync_every",
        "generator.trust_remote_code",
    ],
    "variant=storpo": [
        "variant.completions_per_step",
        "variant.fallback_generations",
        "variant.max_steps",
        "variant.min_steps",
    ],
    "model=tiny": [
        "model.source.hidden_size",
        "model.source.intermediate_size",
        "model.source.num_attention_heads",
        "model.source.num_hidden_layers",
        "model.source.num_key_value_heads",
        "model.source.seed",
    ],
    "model=local": ["model.source.path"],
    "logger=[tensorboard,csv,mlflow,wandb]": [
        "logger.tensorboard.save_dir",
        "logger.tensorboard.name",
        "logger.tensorboard.version",
        "logger.tensorboard.default_hp_metric",
        "logger.csv.save_dir",
        "logger.csv.name",
        "logger.csv.version",
        "logger.mlflow.tracking_uri",
        "logger.mlflow.artifact_location",
        "logger.mlflow.experiment_name",
        "logger.mlflow.run_name",
        "logger.wandb.save_dir",
        "logger.wandb.offline",
        "logger.wandb.project",
        "logger.wandb.name",
        "logger.wandb.log_model",
    ],
    "data=reasoning_gym": [
        "data.dataset.task",
        "data.dataset.task_config",
        "data.dataset.size",
        "data.dataset.seed",
        "data.dataset.eval_seed",
        "data.dataset.split",
        "data.dataset.answer_format",
        "data.dataset.system_prompt",
        "data.dataset.prompt_template",
    ],
    "model=qwen0.5b": ["model.source.repo_id", "model.source.revision"],
}
NO_RULE_TAKES = [[1]]  # a list of lists: no integer, number, choice, string, mapping or device rule accepts it
CASES = [("", key) for key in KEYS] + [(option, key) for option, keys in OPTION_KEYS.items() for key in keys]


@pytest.mark.parametrize(("option", "key"), CASES, ids=[f"{o or 'default'}:{k}" for o, k in CASES])
def test_every_key_is_checked(tmp_path, option, key):
    cfg = make_cfg(tmp_path, [option] if option else [])
    bad = "not a mapping" if OmegaConf.is_dict(OmegaConf.select(cfg, key)) else NO_RULE_TAKES
    with open_dict(cfg):
        OmegaConf.update(cfg, key, bad, force_add=True)
    found = check_rules(cfg)
    assert any(p.startswith(f"{key} must") for p in found), found


def test_constructor_and_config_check_say_the_same(tmp_path):
    from grpo_lightning.generation.base import SamplingConfig

    with pytest.raises(ValueError) as err:
        SamplingConfig(temperature=0)
    cfg = make_cfg(tmp_path, ["generator.temperature=0"])
    assert check_rules(cfg) == [str(err.value)] == ["generator.temperature must be > 0 (got 0)"]
    assert problems({"temperature": 0, "top_k": -1}, SamplingConfig, "generator") == [
        "generator.temperature must be > 0 (got 0)",
        "generator.top_k must be >= 0 (got -1)",
    ]


def test_the_default_config_passes(tmp_path):
    for option in ["", *OPTION_KEYS, "experiment=learn_cpu", "perf=plain", "trainer=ddp"]:
        overrides = [option] if option else []
        if option == "model=local":
            overrides.append(f"model.source.path={tmp_path}")
        assert check_rules(make_cfg(tmp_path, overrides)) == [], option


def test_the_declared_defaults_are_the_default_config(tmp_path):
    """A key's default is its declaration's: every declared key of the default composition that the config does
    not wire to another key (an interpolation) holds the declared default. Options (loss=dapo, perf=plain, ...)
    state only what they change."""
    import dataclasses

    from omegaconf import DictConfig

    from grpo_lightning.app.run_settings import RunSettings
    from grpo_lightning.config_keys import target_schemas
    from grpo_lightning.schema import declared, nested_schema

    differ = []

    def walk(node: DictConfig, path: str, schemas: tuple) -> None:
        target = node.get("_target_") if "_target_" in node else None
        if isinstance(target, str):
            schemas = target_schemas(target) or schemas
        raw = OmegaConf.to_container(node, resolve=False)
        for key in node:
            if key.startswith("_") or (isinstance(raw[key], str) and "${" in raw[key]):
                continue
            value = node[key]
            f = next((declared(s)[key] for s in schemas if key in declared(s)), None)
            if isinstance(value, DictConfig) and (f is None or "schema" in f.metadata):
                walk(value, f"{path}{key}.", tuple(s for s in [nested_schema(schemas, key)] if s))
            elif f is not None:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
                if plain != (list(default) if isinstance(default, tuple) else default):
                    differ.append(f"{path}{key}: config {plain!r}, declared {default!r}")

    cfg = make_cfg(tmp_path, ["generator=vllm", "variant=storpo", "logger=[tensorboard,csv,mlflow,wandb]"])
    with open_dict(cfg):
        cfg.paths.output_dir = ""  # the run directory: Hydra's, per run
    walk(cfg, "", (RunSettings,))
    walk(make_cfg(tmp_path, []).generator, "generator.", ())
    assert differ == []


def test_import_target_and_settings_from():
    """`_target_` paths resolve without Hydra (None for what does not import); a Configured class builds one
    settings object per type from a node's keys, omegaconf containers as plain Python, an unknown key refused."""
    from dataclasses import dataclass

    from omegaconf import OmegaConf

    from grpo_lightning.schema import Configured, import_target, integer, setting, strings, target_class

    assert target_class("grpo_lightning.variants.storpo.STORPO").__name__ == "STORPO"
    assert import_target("grpo_lightning.data.source.test_split_of").__name__ == "test_split_of"
    assert target_class("grpo_lightning.data.source.test_split_of") is None  # a function, not a class
    for missing in ("no_such_package.X", "grpo_lightning.variants.storpo.Nope", "", "a..b", None):
        assert import_target(missing) is None

    @dataclass(frozen=True)
    class Sizes:
        count: int = setting(2, integer(1))

    @dataclass(frozen=True)
    class Names:
        names: list = setting(rule=strings, factory=lambda: ["a"])

    class Thing(Configured):
        settings_types = (Sizes, Names)

    node = OmegaConf.create({"count": 3, "names": ["x", "y"]})
    sizes, names = Thing.settings_from(dict(node.items()))
    assert sizes == Sizes(3) and names.names == ["x", "y"] and type(names.names) is list
    with pytest.raises(TypeError, match="Thing got unexpected keys: colour"):
        Thing.settings_from({"count": 3, "colour": "red"})


def test_settings_of_reads_what_a_node_sets_and_the_declared_defaults_for_the_rest():
    """`settings_of`: the keys the node sets (interpolations resolved, containers as plain Python), nested settings
    built the same way, the declared defaults for keys the node leaves out, keys it does not declare ignored."""
    from dataclasses import dataclass

    from omegaconf import OmegaConf

    from grpo_lightning.schema import integer, setting, settings_of

    @dataclass(frozen=True)
    class Inner:
        rank: int = setting(8, integer(1))

    @dataclass(frozen=True)
    class Outer:
        size: int = setting(2, integer(1))
        names: list = setting(factory=list)
        inner: Inner = setting(factory=Inner)

    node = OmegaConf.create({"size": "${n}", "names": ["a"], "inner": {"rank": 4}, "other": 1, "n": 5})
    assert settings_of(node, Outer) == Outer(size=5, names=["a"], inner=Inner(rank=4))
    assert settings_of(OmegaConf.create({}), Outer) == Outer()
    assert type(settings_of(node, Outer).names) is list
