"""tests/compose_cache.py's folder of compositions: what it loads is what Hydra composes, and any change to the
config files names new entries. Truth: Hydra's own compose (`compose_cache._real_compose`)."""

from __future__ import annotations

import shutil

import pytest
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from tests import compose_cache
from tests.conftest import CONF_DIR

OVERRIDES = ["model=tiny", "loss=dapo", "generator.max_new_tokens=8", "~reward.terms.gsm8k"]


def _seen(cfg) -> tuple:
    return OmegaConf.to_yaml(cfg), cfg._get_flag("struct"), cfg._get_flag("readonly"), list(cfg)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty folder of compositions, and an empty in-process cache, for this test only."""
    monkeypatch.setattr(compose_cache, "_disk", {"folder": tmp_path, "conf_dir": CONF_DIR, "digest": None})
    monkeypatch.setattr(compose_cache, "_cache", {})
    return tmp_path


def test_a_kept_composition_loads_as_hydra_composes_it(folder):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        truth = compose_cache._real_compose("config", OVERRIDES, False)
        first = compose_cache.cached_compose("config", OVERRIDES, False)  # composed, then kept
        (kept,) = folder.glob("*.pkl")  # one entry: the group choices' composition, before the other overrides
        compose_cache._cache.clear()  # as another process: nothing in memory
        before = compose_cache.stats()
        second = compose_cache.cached_compose("config", OVERRIDES, False)
        after = compose_cache.stats()
    assert after["loaded"] == before["loaded"] + 1 and after["misses"] == before["misses"]
    assert _seen(first) == _seen(second) == _seen(truth)
    assert second.generator.max_new_tokens == 8 and "gsm8k" not in second.reward.terms
    assert kept.stat().st_size > 0


def test_a_torn_entry_is_composed_again_and_rewritten(folder):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        compose_cache.cached_compose("config", OVERRIDES, False)
        (kept,) = folder.glob("*.pkl")
        kept.write_bytes(kept.read_bytes()[:100])  # a file cut short
        compose_cache._cache.clear()
        before = compose_cache.stats()
        cfg = compose_cache.cached_compose("config", OVERRIDES, False)
        truth = compose_cache._real_compose("config", OVERRIDES, False)
    assert compose_cache.stats()["misses"] == before["misses"] + 1
    assert _seen(cfg) == _seen(truth)
    assert compose_cache._load(kept) is not None  # rewritten whole


def test_any_change_to_the_config_files_changes_the_digest(tmp_path):
    copy = tmp_path / "conf"
    shutil.copytree(CONF_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = compose_cache._conf_digest(str(copy))
    assert digest == compose_cache._conf_digest(CONF_DIR)  # the same files: the same entries
    loss = copy / "loss" / "grpo.yaml"
    text = loss.read_text()
    loss.write_text(text + " ")
    assert compose_cache._conf_digest(str(copy)) != digest  # one byte more
    loss.write_text(text)
    assert compose_cache._conf_digest(str(copy)) == digest
    (copy / "loss" / "mine.yaml").write_text("loss_type: grpo\n")
    assert compose_cache._conf_digest(str(copy)) != digest  # a new option
    (copy / "loss" / "mine.yaml").unlink()
    (copy / "loss" / "grpo.yaml").rename(copy / "loss" / "grpo2.yaml")
    assert compose_cache._conf_digest(str(copy)) != digest  # a renamed file
