"""The GPU recipes (conf/experiment/gsm8k_qwen*.yaml) compose, validate and print their plan on a CPU machine.

No GPU, no network: the platform is faked (vLLM's CUDA build, two 80 GiB GPUs) and the Hub cache holds the
config.json of each Qwen model, written here with the published architecture values, so the dry run reads the
model's shape as it would after a download. Independent truth: the parameter counts on the Qwen2.5 model cards
(0.49B and 1.54B), against the estimate's weights term.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.test_bad_input import cli

GIB = 2**30
QWEN = {  # Qwen2.5-*-Instruct config.json values (architecture keys only)
    "Qwen/Qwen2.5-0.5B-Instruct": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2),
}  # fmt: skip
CARD_PARAMETERS = {"Qwen/Qwen2.5-0.5B-Instruct": 0.49e9, "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9}
RECIPES = {"gsm8k_qwen0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "gsm8k_qwen1.5b_2gpu": "Qwen/Qwen2.5-1.5B-Instruct"}


@pytest.fixture
def cuda_machine(tmp_path, monkeypatch):
    """Two 80 GiB GPUs, vLLM's CUDA build, and a Hub cache with the Qwen configs (no weights, no network)."""
    from huggingface_hub import constants

    from grpo_lightning.app import validation

    cache = tmp_path / "hub"
    for repo, arch in QWEN.items():
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0" * 40)
        config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
                  "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                  **arch}  # fmt: skip
        (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: "cuda")
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("grpo_lightning.app.plan.gpu_memory", lambda: 80 * GIB)
    monkeypatch.setattr("grpo_lightning.app.run_shape.gpu_memory", lambda: 80 * GIB)
    monkeypatch.setattr(validation, "check_accelerator", lambda cfg: None)
    return cache


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_plan_with_gpu_memory_estimate(tmp_path, cuda_machine, recipe):
    result = cli(f"experiment={recipe}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.startswith("  "))
    assert plan["rounds"] == "116" and plan["prompts_per_round"] == "64" and plan["rollouts_per_round"] == "512"
    assert plan["model"] == f"hub:{RECIPES[recipe]}"
    print(recipe, *(f"{k}: {v}" for k, v in plan.items() if k.startswith("memory")), sep="\n  ")
    weights = float(plan["memory_gpu_trainer"].split("weights ")[1].split(",")[0].rstrip(")")) * GIB
    assert weights / 2 == pytest.approx(CARD_PARAMETERS[RECIPES[recipe]], rel=0.01)  # bfloat16: 2 bytes each
    trainer_gib = float(plan["memory_gpu_trainer"].split()[0].lstrip("~"))
    assert trainer_gib < 80  # fits the GPU it was written for
    if recipe.endswith("2gpu"):
        assert plan["memory_gpu_engine"].startswith(f"~{0.85 * 80:.2f} GiB")  # the engine's own GPU
    else:
        assert "vLLM engine" in plan["memory_gpu_trainer"] or "memory_gpu_engine" not in plan


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_that_cannot_fit_names_the_key(tmp_path, cuda_machine, recipe):
    result = cli(f"experiment={recipe}", "data.groups_per_micro_batch=64", "generator.max_new_tokens=2048",
                 "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "GiB of GPU memory" in line and "lower data.groups_per_micro_batch" in line


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_login_node_prints_the_plan_and_gpu_estimate_before_what_it_lacks(tmp_path, monkeypatch, recipe):
    """No GPU, no vLLM, no network and an empty Hub cache: the plan and its GPU memory estimate come from the
    published architecture (models/architectures.py), and only then the line saying what this machine lacks."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = cli(f"experiment={recipe}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0
    plan = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.startswith("  "))
    weights = float(plan["memory_gpu_trainer"].split("weights ")[1].split(",")[0].rstrip(")")) * GIB
    assert weights / 2 == pytest.approx(CARD_PARAMETERS[RECIPES[recipe]], rel=0.01)
    (line,) = result.stderr.strip().splitlines()
    assert "generator=vllm needs vLLM" in line and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("architecture", "card"),
    [("Qwen/Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen/Qwen2.5-1.5B-Instruct", 1.54e9),
     ("Qwen/Qwen2.5-3B-Instruct", 3.09e9), ("Qwen/Qwen2.5-7B-Instruct", 7.61e9)],
)  # fmt: skip
def test_random_weight_presets_have_the_published_parameter_counts(architecture, card):
    """The model cards' counts, against the architecture built on the meta device (no weights)."""
    from grpo_lightning.app.memory import model_shape
    from grpo_lightning.models.sources import ArchitectureSource

    shape = model_shape(ArchitectureSource(architecture=architecture).config(), 16, "all-linear")
    assert shape.parameters == pytest.approx(card, abs=0.006e9)  # the cards give two decimals of a billion


TOKENIZER_FOLDER = (
    "~model.source.tokenizer_source",
    "+model.source.tokenizer_source._target_=grpo_lightning.models.sources.TokenizerFolder",
)  # docs/gpu.md: a random-weight preset's tokenizer from a folder (a GPU node without the package)


def test_a_random_weight_preset_takes_its_tokenizer_from_a_folder(tmp_path, tokenizer):
    """The documented overrides: the dry run plans the 1.5B architecture with the tokenizer saved in a folder, and
    that folder gives the embedded tokenizer back (same vocabulary, same ids for a text)."""
    from grpo_lightning.models.sources import TokenizerFolder

    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    result = cli("model=random_qwen1.5b", *TOKENIZER_FOLDER, f"+model.source.tokenizer_source.path={folder}",
                 "dry_run=true", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "random-weights:Qwen/Qwen2.5-1.5B-Instruct" in result.stdout
    loaded = TokenizerFolder(str(folder)).load_tokenizer()
    text = "Natalia sold clips to 48 of her friends."
    assert len(loaded) == len(tokenizer) and loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert TokenizerFolder(str(folder)).vocab_size() == len(tokenizer)


def test_a_tokenizer_folder_without_a_tokenizer_names_the_key(tmp_path):
    result = cli("model=random_qwen0.5b", *TOKENIZER_FOLDER, f"+model.source.tokenizer_source.path={tmp_path}",
                 "dry_run=true", cwd=tmp_path)  # fmt: skip
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: model.source.tokenizer_source.path:") and "tokenizer_config.json" in line
