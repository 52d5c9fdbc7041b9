"""Every option of every config group composes, and its objects instantiate (models are not loaded)."""

from pathlib import Path

import pytest
from hydra.utils import get_class, instantiate

from grpo_lightning.accel import ForwardSettings, GenerationSettings
from grpo_lightning.app.launch import trainer_node
from grpo_lightning.rewards.pipeline import build_reward
from tests.conftest import CONF_DIR, make_cfg

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in Path(CONF_DIR).iterdir() if g.is_dir()}
PLAIN_PERF = (ForwardSettings.plain(), GenerationSettings.plain())
GPU_PERF = (  # perf=gpu, written out: checkpointed layers and a chunked head; graphs through the LoRA layers
    ForwardSettings(
        share_prefix=False, logits_chunk_tokens=1024, runs_by_length=False, fused_lora=False,
        activation_checkpointing=True,
    ),
    GenerationSettings(merge_lora=False, packed_weights=False),
)  # fmt: skip
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")
OPTIONS = [(group, option) for group, options in sorted(GROUPS.items()) for option in options]


def test_expected_groups_exist():
    assert GROUPS["loss"] == [
        "bnpo",
        "cispo",
        "dapo",
        "dr_grpo",
        "grpo",
        "grpo_clip_higher",
        "gspo",
        "luspo",
        "sapo",
        "vespo",
    ]
    assert GROUPS["model"] == [
        "local",
        "qwen0.5b",
        "qwen1.5b",
        "random_qwen0.5b",
        "random_qwen1.5b",
        "random_qwen7b",
        "smollm2_135m",
        "tiny",
    ]  # random_*: published shapes with random weights (speed and memory only)
    assert GROUPS["trainer"] == ["cpu", "ddp", "default", "fsdp", "gpu"]  # default: what the others share
    assert GROUPS["reward"] == [
        "gsm8k", "gsm8k_math_verify", "gsm8k_shaped", "reasoning_gym", "reasoning_gym_shaped", "selfplay",
        "selfplay_rae", "selfplay_role",
    ]  # fmt: skip
    assert GROUPS["data"] == ["games", "gsm8k", "reasoning_gym", "rounds"]  # rounds: what the sources share
    assert GROUPS["variant"] == ["grpo", "selfplay", "storpo"]
    assert GROUPS["perf"] == ["cpu_fast", "gpu", "plain"]
    assert {"variant", "generator", "data", "trainer", "logger"} <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(tmp_path, group, option):
    required = []
    if (group, option) == ("model", "local"):  # a folder shaped like save_pretrained's (LocalSource checks it)
        (tmp_path / "config.json").write_text('{"model_type": "llama"}')
        (tmp_path / "model.safetensors").write_bytes(b"")
        required = [f"model.source.path={tmp_path}"]
    cfg = make_cfg(tmp_path, [f"{group}={option}", *required])
    if group == "experiment":  # '# @package _global_' bundles: they set keys across groups, not a node
        assert "experiment" not in cfg and instantiate(cfg.variant) is not None
        return
    node = trainer_node(cfg) if group == "trainer" else cfg[group]  # as the run builds it: the timeout is its own
    if group == "model":
        source = instantiate(node.source)  # builds the source object, loads nothing
        assert source.describe()
    elif group == "trainer" and option == "ddp":
        assert instantiate(node, accelerator="cpu").world_size == 2  # builds; processes start only at fit
    elif group == "trainer" and option == "fsdp":
        assert instantiate(node, accelerator="cpu").world_size == 2  # FSDP2 (grpo_lightning/sharding.py) on gloo
    elif group == "trainer" and option != "cpu":
        assert get_class(node._target_) is not None  # a GPU trainer cannot be built on a CPU machine
    elif group == "reward" and option.startswith("reasoning_gym"):  # the task's verifier, given by the record
        from grpo_lightning.rewards.reasoning_gym import TaskRecord

        record = TaskRecord({"answer": "3"}, lambda answer, entry: float(answer == entry["answer"]), "hash")
        assert build_reward(node, loss_type="grpo", max_new_tokens=16)("#### 3", "3", record=record) >= 1.0
    elif group == "reward" and option.startswith("selfplay"):  # a game turn's record (docs/selfplay.md)
        from grpo_lightning.types import TurnRecord

        won = TurnRecord(
            "tictactoe", 0, 0, "[4]", illegal=False, outcome=1.0, opponent="random", learner_turns=1, payoff=1.0
        )
        lost = TurnRecord(
            "tictactoe", 1, 0, "[9]", illegal=True, outcome=-1.0, opponent="random", learner_turns=1, payoff=-1.0
        )
        pipeline = build_reward(node, loss_type="grpo", max_new_tokens=16)
        assert pipeline("[4]", "", record=won) == 1.0  # win 1 + legal 0 (the role baseline starts at 0)
        assert pipeline("[9]", "", record=lost) == -2.0  # loss -1 + illegal -1 (the other seat's baseline: 0)
    elif group == "reward":  # a pipeline of terms and transforms, built by grpo_lightning.rewards.pipeline
        assert build_reward(node, loss_type="grpo", max_new_tokens=16)("#### 3", "3") >= 1.0
    elif group == "data" and option == "rounds":  # the round's shape every source extends, not a source
        assert "dataset" not in node and node.prompts_per_round == 2
    elif group == "callbacks":  # built by the run with its objects (app/train.py build_callbacks)
        from grpo_lightning.app.parts import REQUIRED_CALLBACKS, callback_parameters

        parameters = callback_parameters(node)
        assert set(REQUIRED_CALLBACKS) <= set(parameters)
        assert {"generator", "variant", "reward_fn", "datamodule", "tokenizer", "stop"} <= set(
            parameters["rollout_loop"]
        )
    elif group == "generator" and option == "sampling":  # the sampling every engine extends, not an engine
        assert "_target_" not in node and set(node) == set(SAMPLING_KEYS)
    elif group == "generator":
        assert get_class(node._target_) is not None  # needs a model; built in test_train
    elif group == "logger":  # one node per tracker (a multi-select group), built by the run (app/train.py)
        from grpo_lightning.app.parts import build_loggers

        (logger,) = build_loggers(cfg)
        assert type(logger) is get_class(node[option]._target_)
        where = {  # every tracker writes under the run directory by default
            "tensorboard": lambda: logger.log_dir,
            "csv": lambda: logger.log_dir,
            "wandb": lambda: logger.save_dir,
            # the configured store; opening it (`logger.experiment`: MLflow migrates a new SQLite database, 6 s)
            # and finding the run's experiment there: tests/test_tracking_runs.py::test_mlflow_and_csv_hold_the_run
            "mlflow": lambda: node.mlflow.tracking_uri.removeprefix("sqlite:///"),
        }[option]()
        assert Path(where).resolve().is_relative_to(tmp_path.resolve()), where
        if option == "mlflow":
            assert Path(node.mlflow.artifact_location).is_relative_to(tmp_path)
    elif group == "perf":  # the speed levers: frozen settings objects, every lever on or every lever off
        forward, generate = instantiate(node.forward), instantiate(node.generate)
        expected = {"cpu_fast": (ForwardSettings(), GenerationSettings()), "plain": PLAIN_PERF, "gpu": GPU_PERF}[option]
        assert (forward, generate) == expected
    else:
        assert instantiate(node) is not None


@pytest.mark.parametrize(
    ("overrides", "perf"),
    [
        (["trainer=gpu"], GPU_PERF),
        (["trainer=gpu", "perf=cpu_fast"], (ForwardSettings(), GenerationSettings())),  # the command line wins
        (["perf=plain", "trainer=gpu"], PLAIN_PERF),  # in either order
        (["experiment=gsm8k_qwen0.5b"], GPU_PERF),  # the GPU recipes train with trainer=gpu's levers
        (["experiment=gsm8k_qwen1.5b_2gpu"], GPU_PERF),
        ([], (ForwardSettings(), GenerationSettings())),  # the CPU default keeps its levers
        (["trainer=ddp"], (ForwardSettings(), GenerationSettings())),
    ],
)
def test_trainer_gpu_selects_the_gpu_levers(tmp_path, overrides, perf):
    cfg = make_cfg(tmp_path, overrides)
    assert (instantiate(cfg.perf.forward), instantiate(cfg.perf.generate)) == perf


def test_top_level_nodes_instantiate(tmp_path):
    cfg = make_cfg(tmp_path)
    assert build_reward(cfg.reward)("#### 3", "3") == 1.0
    assert instantiate(cfg.optim.schedule).factor(0, 10) > 0
    assert callable(instantiate(cfg.optim.optimizer))


@pytest.mark.parametrize(
    "overrides", [[], ["experiment=learn_cpu"], ["generator.temperature=0.9", "generator.top_k=5"]]
)
def test_both_engines_compose_the_same_sampling(tmp_path, overrides):
    """generator=vllm changes the engine, never the algorithm: G, temperature, top-p, top-k and new tokens agree."""
    hf, vllm = (make_cfg(tmp_path, [f"generator={engine}", *overrides]).generator for engine in ("hf", "vllm"))
    assert {k: hf[k] for k in SAMPLING_KEYS} == {k: vllm[k] for k in SAMPLING_KEYS}
    assert hf._target_ != vllm._target_


def test_rounds_are_not_a_hardware_choice(tmp_path):
    rounds = {option: make_cfg(tmp_path, [f"trainer={option}"]).trainer.max_epochs for option in GROUPS["trainer"]}
    assert len(set(rounds.values())) == 1, rounds


def test_choosing_the_sampling_base_as_an_engine_names_the_key(tmp_path):
    from grpo_lightning.app.validation import validate

    with pytest.raises(ValueError, match="generator=sampling is the sampling every engine shares"):
        validate(make_cfg(tmp_path, ["generator=sampling"]))


def test_callbacks_are_built_from_config_with_the_run_objects(tmp_path):
    """The entries the run builds itself (the stop, the rollout loop) keep their place in the order; every other
    entry gets its config arguments plus the run objects its constructor names; None adds nothing."""
    from grpo_lightning.app.parts import build_callbacks

    cfg = make_cfg(tmp_path, ["trainer.enable_progress_bar=false", "+callbacks.mine._target_=tests.helpers.Recorder"])
    objects = {name: object() for name in ("generator", "variant", "reward_fn", "datamodule", "tokenizer")}
    objects["evaluator"] = None
    by_the_run = {"stop": object(), "rollout_loop": object()}
    built = build_callbacks(cfg.callbacks, objects, by_the_run)
    assert list(built) == ["stop", "rollout_loop", "round_checkpoint", "last_checkpoint", "save_policy", "mine"]
    assert built["stop"] is by_the_run["stop"] and built["rollout_loop"] is by_the_run["rollout_loop"]
    assert built["save_policy"].tokenizer is objects["tokenizer"]
    assert built["mine"].tokenizer is objects["tokenizer"]  # a user's callback asks by parameter name
    assert str(built["last_checkpoint"].dirpath) == f"{tmp_path}/checkpoints"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["~callbacks.rollout_loop"], "callbacks.rollout_loop is required"),
        (["+callbacks.mine._target_=no.such.Callback"], "callbacks.mine._target_: cannot import 'no.such.Callback'"),
    ],
)
def test_callback_mistakes_name_the_key(tmp_path, overrides, words):
    from grpo_lightning.app.parts import callback_parameters

    with pytest.raises(ValueError, match=words):
        callback_parameters(make_cfg(tmp_path, overrides).callbacks)


RECIPES = GROUPS["experiment"]
LOSSES = GROUPS["loss"]


def _loss_block(tmp_path, overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(make_cfg(tmp_path, overrides).loss, resolve=False)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_loss_chosen_with_a_recipe_keeps_its_own_preset(tmp_path, recipe):
    """`experiment=R loss=L` composes exactly `loss=L`'s block (its preset's values, interpolations unresolved), for
    every recipe and every loss preset; a user's override on top changes that key only. A recipe that needs other
    loss values chooses a loss preset (`override /loss: ...`), which a loss= on the command line replaces whole."""
    for loss in LOSSES:
        alone = _loss_block(tmp_path, [f"loss={loss}"])
        assert _loss_block(tmp_path, [f"experiment={recipe}", f"loss={loss}"]) == alone, (recipe, loss)
        assert _loss_block(tmp_path, [f"loss={loss}", f"experiment={recipe}"]) == alone, (recipe, loss)  # either order
        tuned = _loss_block(tmp_path, [f"experiment={recipe}", f"loss={loss}", "loss.beta=0.07"])
        assert tuned == alone | {"beta": 0.07}, (recipe, loss)


def test_recipes_set_no_loss_key_of_their_own():
    """A recipe's loss values live in a loss preset it chooses, never in its own `loss:` block (which would overrule
    whatever loss the user picks)."""
    from omegaconf import OmegaConf

    for recipe in RECIPES:
        node = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{recipe}.yaml")
        assert "loss" not in node, recipe


def test_the_clip_higher_recipes_train_with_their_loss_as_before(tmp_path):
    """learn_cpu and learn_arith compose grpo with epsilon_high 0.28 (and beta 0), as when they set those keys."""
    for recipe in ("learn_cpu", "learn_arith"):
        block = _loss_block(tmp_path, [f"experiment={recipe}"])
        assert block == _loss_block(tmp_path, ["loss=grpo"]) | {"epsilon_high": 0.28}, recipe
        assert block["beta"] == 0.0 and block["loss_type"] == "grpo"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "~/.cache/grpo_lightning"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/grpo_lightning"),  # the XDG base directory specification
        ({"XDG_CACHE_HOME": "/xdg", "GRPO_LIGHTNING_CACHE": "/own"}, "/own"),  # the project's own variable wins
    ],
)
def test_the_cache_follows_the_environment(tmp_path, monkeypatch, env, expected):
    for name in ("XDG_CACHE_HOME", "GRPO_LIGHTNING_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert make_cfg(tmp_path).paths.cache_dir == expected
