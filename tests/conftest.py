"""Shared fixtures: composed configs (Hydra compose API) and the tiny random model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def make_cfg(output_dir: Path, overrides: list[str] | None = None) -> DictConfig:
    """Compose `conf/config.yaml` with overrides, as the CLI would, writing into `output_dir`."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


TINY = [
    "model=tiny",
    "trainer.max_epochs=2",
    "generator.max_new_tokens=16",
    "trainer.enable_progress_bar=false",
    # A dense reward so a random model gets non-zero advantages (GSM8K correctness would be 0 everywhere).
    "reward._target_=tests.helpers.VowelFractionReward",
    "~reward.format_bonus",
    "optim.optimizer.lr=1e-3",
    "eval.num_problems=4",
]


@pytest.fixture
def tiny_cfg(tmp_path):
    """Factory: a tiny-model config in a fresh output dir, plus extra overrides."""

    counter = iter(range(1000))

    def factory(*overrides: str) -> DictConfig:
        return make_cfg(tmp_path / f"run{next(counter)}", TINY + list(overrides))

    return factory


@pytest.fixture(scope="session")
def tokenizer():
    from grpo_lightning.models import PackagedGGUFSource

    cache = os.environ.get("GRPO_LIGHTNING_CACHE", "~/.cache/grpo_lightning")
    return PackagedGGUFSource(cache_dir=cache).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from grpo_lightning.models import RandomSource

    cache = os.environ.get("GRPO_LIGHTNING_CACHE", "~/.cache/grpo_lightning")
    source = RandomSource(tokenizer_source=_packaged(cache), seed=0)
    model, _ = source.load(torch.float32)
    return model.eval()


def _packaged(cache: str):
    from grpo_lightning.models import PackagedGGUFSource

    return PackagedGGUFSource(cache_dir=cache)


def pytest_collection_modifyitems(config, items):
    """Real vLLM engines last: the in-process engine (tests/test_vllm.py) initialises torch.distributed and keeps
    its memory for the session, so nothing else runs after it in the same process."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)  # stable: file order otherwise
