"""benchmarks/vs_trl.py pins every setting it compares on both sides: our composed config carries each pinned
value, TRL's GRPOConfig (and LoraConfig) carries the same, and nothing that shapes the work is left to a default
that differs between the two (sampling, dynamic sampling, the loss, lengths, the optimizer). TRL is a
benchmark-only extra: without it, only its side is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR
from tests.helpers import load_benchmark

BENCH = load_benchmark("vs_trl")
PIN_SETS = {"timing": lambda loss: BENCH.pins(loss, steps=3), "check": BENCH.check_pins}
"""The timing benchmark's settings (4 prompts x 4 per step, micro-batches of 4) and --check's (one batch)."""
CASES = [(loss, which) for loss in BENCH.LOSSES for which in PIN_SETS]


def composed(cfg, key: str):
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@pytest.mark.parametrize(("loss", "which"), CASES, ids=[f"{loss}-{which}" for loss, which in CASES])
def test_our_side_composes_to_every_pinned_value(tmp_path, loss, which):
    pinned = PIN_SETS[which](loss)
    cfg = BENCH.compose(str(tmp_path), pinned)
    for pin in pinned:
        if pin.ours not in (None, "loss"):
            assert composed(cfg, pin.ours) == pin.our_value, pin.what
    built = instantiate(cfg.loss)  # the loss the run builds from it
    spec = BENCH.LOSSES[loss]
    assert (built.loss_type, built.importance_sampling_level) == (spec["loss_type"], spec["importance_sampling_level"])
    assert (built.epsilon_low, built.epsilon_high) == (spec["epsilon_low"], spec["epsilon_high"])
    assert built.beta == BENCH.BETA
    assert not built.rollout_correction.active
    # what was not pinned before: our defaults filter groups (extra sampling) and sample at 0.7
    assert cfg.data.dynamic_sampling.enabled is False and cfg.generator.temperature == 1.0


def test_every_sampling_and_loss_key_is_pinned():
    """A sampling key added to generator/sampling.yaml, or a loss key, must be pinned here too."""
    pinned = {pin.ours for pin in BENCH.pins()}
    sampling = OmegaConf.load(Path(CONF_DIR) / "generator" / "sampling.yaml")
    assert {f"generator.{key}" for key in sampling} <= pinned
    loss = OmegaConf.load(Path(CONF_DIR) / "loss" / "grpo.yaml")
    keys = {f"loss.{key}" for key in loss if key not in ("defaults", "_target_")}
    assert keys <= pinned
    assert "loss.rollout_correction.enabled" in pinned  # its other keys act only when it is on


def test_both_sides_are_the_same_work():
    """Equal values where both systems name the setting alike; the batch layout by its relations."""
    sets = [(BENCH.pins(), BENCH.MICRO, BENCH.PROMPTS_PER_STEP, False)]
    sets += [(BENCH.pins(bf16=True), BENCH.MICRO, BENCH.PROMPTS_PER_STEP, True)]
    sets += [(BENCH.check_pins("grpo"), BENCH.CHECK_MICRO, BENCH.CHECK_PROMPTS, False)]
    for pinned, micro, prompts, bf16 in sets:
        rows = {pin.what: pin for pin in pinned}
        layout = ("completions per micro-batch", "micro-batches per optimizer step", "precision")
        for pin in rows.values():
            if pin.ours is not None and pin.trl is not None and not pin.what.startswith(layout):
                assert pin.our_value == pin.trl_value, pin.what
        precision = next(p for w, p in rows.items() if w.startswith("precision"))
        assert (precision.our_value == "bfloat16") is precision.trl_value is bf16
        per_micro = next(p for w, p in rows.items() if w.startswith(layout[0]))
        accumulation = next(p for w, p in rows.items() if w.startswith(layout[1]))
        assert per_micro.our_value * BENCH.GROUP == per_micro.trl_value == micro  # whole groups of G
        assert accumulation.our_value is None  # ours: one optimizer step per round, all its micro-batches
        assert accumulation.trl_value * micro == prompts * BENCH.GROUP


@pytest.mark.parametrize("loss", list(BENCH.LOSSES))
def test_trl_side_carries_every_pinned_value(tmp_path, loss):
    pytest.importorskip("trl")
    for which, pinned_for in PIN_SETS.items():
        pinned = pinned_for(loss)
        args = BENCH.trl_args(str(tmp_path), pinned, gc=False)
        lora = BENCH.lora_config(pinned)
        for pin in pinned:
            if pin.trl is None:
                continue
            source = lora if pin.trl.startswith("lora.") else args
            names = pin.trl.removeprefix("lora.").split(",")
            values = [getattr(getattr(source, name), "value", getattr(source, name)) for name in names]
            assert (values if len(names) > 1 else values[0]) == pin.trl_value, pin.what
        prompts = BENCH.PROMPTS_PER_STEP if which == "timing" else BENCH.CHECK_PROMPTS
        assert args.generation_batch_size == prompts * BENCH.GROUP  # one sampling pass per optimizer step


@pytest.mark.parametrize(("loss", "which"), CASES, ids=[f"{loss}-{which}" for loss, which in CASES])
def test_trl_liger_differs_from_trl_only_by_the_liger_kernel(tmp_path, loss, which):
    """`trl_liger` is TRL's side with `use_liger_kernel=True` and every other GRPOConfig field as `trl`'s."""
    pinned = PIN_SETS[which](loss)
    for gpu, fixed_length in ((False, False), (True, True)):
        plain = BENCH.trl_config(str(tmp_path), pinned, gc=True, gpu=gpu, fixed_length=fixed_length, system="trl")
        liger = BENCH.trl_config(str(tmp_path), pinned, True, gpu, fixed_length, system="trl_liger")
        assert plain["use_liger_kernel"] is False and liger["use_liger_kernel"] is True
        assert {key for key in plain.keys() | liger.keys() if plain.get(key) != liger.get(key)} == {"use_liger_kernel"}
        assert plain == BENCH.trl_config(str(tmp_path), pinned, True, gpu, fixed_length)  # `trl` is the default
        assert BENCH.trl_fields(pinned).items() <= liger.items()  # every pinned field, on both


def test_trl_systems_are_timed_systems():
    assert set(BENCH.TRL_SYSTEMS) == {"trl", "trl_liger"} <= set(BENCH.SYSTEM_NAMES)
    assert not set(BENCH.TRL_SYSTEMS) & set(BENCH.OUR_SYSTEMS)


def test_trl_liger_config_sets_the_liger_kernel(tmp_path):
    pytest.importorskip("trl")
    pinned = BENCH.pins(steps=3)
    assert BENCH.trl_args(str(tmp_path), pinned, gc=True, system="trl_liger").use_liger_kernel is True
    assert BENCH.trl_args(str(tmp_path), pinned, gc=True).use_liger_kernel is False
