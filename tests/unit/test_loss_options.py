"""The loss node against its loss type (algorithm/loss_types.py): another type's options (`loss.sapo`, `loss.vespo`),
the values a type runs with only (`LossType.requires`: VESPO without the separate rollout correction) and the sign
of the entropy bonus, each refused in one line naming the keys, in the config check (`validate`) as in a direct
construction, and never changed behind the user's back."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_lightning.algorithm.loss_types import _REGISTRY, SapoSettings, VespoSettings
from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollout_correction import RolloutCorrection
from grpo_lightning.app.build import build
from grpo_lightning.app.validation import validate
from tests.conftest import make_cfg
from tests.test_bad_input import assert_clean_failure, cli

CONF = Path(__file__).resolve().parents[2] / "grpo_lightning" / "conf" / "loss"
VESPO_NEEDS = (
    "with loss_type vespo: VESPO weighs whole sequences by their own importance weight, so loss.loss_type=vespo runs "
    "only with loss.rollout_correction.enabled=false; choose its preset, loss=vespo, which sets it, or set "
    "loss.rollout_correction.enabled=false"
)


def refusal(tmp_path, overrides: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        validate(make_cfg(tmp_path, overrides), platform=False)
    return str(err.value)


# ---- another type's options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["loss=grpo", "+loss.sapo.temperature_pos=2"],
            "loss.sapo: options of loss_type sapo, but loss.loss_type is grpo: remove loss.sapo or set "
            "loss.loss_type=sapo",
        ),
        (
            ["loss=grpo", "+loss.vespo.k_pos=3"],
            "loss.vespo: options of loss_type vespo, but loss.loss_type is grpo: remove loss.vespo or set "
            "loss.loss_type=vespo",
        ),
        (
            ["loss=dapo", "+loss.sapo.temperature_neg=1.0"],  # a default value is still a node of another type
            "loss.sapo: options of loss_type sapo, but loss.loss_type is dapo: remove loss.sapo or set "
            "loss.loss_type=sapo",
        ),
    ],
)
def test_options_of_a_type_not_selected_are_refused(tmp_path, overrides, message):
    assert refusal(tmp_path, overrides) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss=sapo", "loss.sapo.temperature_pos=2"],
        ["loss=vespo", "loss.vespo.k_pos=3"],
        ["loss=grpo", "loss.loss_type=sapo", "+loss.sapo.temperature_pos=2"],  # sapo has no required value
    ],
)
def test_options_of_the_selected_type_are_taken(tmp_path, overrides):
    cfg = make_cfg(tmp_path, overrides)
    validate(cfg, platform=False)
    loss = build(cfg.loss)
    assert (loss.sapo.temperature_pos if loss.loss_type == "sapo" else loss.vespo.k_pos) in (2, 3)


# ---- a preset's type changed: refused naming the keys and the preset to use ------------------------------------------
def test_a_sapo_preset_switched_to_vespo_names_both_problems_and_the_vespo_preset(tmp_path):
    message = refusal(tmp_path, ["loss=sapo", "loss.loss_type=vespo"])
    assert message == (
        "loss.sapo: options of loss_type sapo, but loss.loss_type is vespo: choose the preset of vespo, loss=vespo, "
        "rather than changing loss.loss_type after loss=sapo (each preset sets what its type runs with), or remove "
        f"loss.sapo; loss.rollout_correction.enabled=auto {VESPO_NEEDS}"
    )
    assert "\n" not in message


def test_a_vespo_preset_switched_to_sapo_names_the_sapo_preset(tmp_path):
    assert refusal(tmp_path, ["loss=vespo", "loss.loss_type=sapo"]).startswith(
        "loss.vespo: options of loss_type vespo, but loss.loss_type is sapo: choose the preset of sapo, loss=sapo,"
    )


@pytest.mark.parametrize("value", ["auto", "true"])
def test_vespo_with_the_rollout_correction_not_off_is_refused_not_changed(tmp_path, value):
    """`auto` is refused too: it turns the correction on wherever the engine differs from the trainer (a bf16 vLLM
    engine), where VESPO's own weight already corrects."""
    overrides = ["loss=grpo", "loss.loss_type=vespo", f"loss.rollout_correction.enabled={value}"]
    cfg = make_cfg(tmp_path, overrides)
    with pytest.raises(ValueError) as err:
        validate(cfg, platform=False)
    assert str(err.value) == f"loss.rollout_correction.enabled={value} {VESPO_NEEDS}"
    assert str(cfg.loss.rollout_correction.enabled).lower() == value  # the user's value, untouched


def test_vespo_with_the_correction_off_runs_on_any_preset(tmp_path):
    cfg = make_cfg(tmp_path, ["loss=grpo", "loss.loss_type=vespo", "loss.rollout_correction.enabled=false"])
    validate(cfg, platform=False)
    assert build(cfg.loss).loss_type == "vespo"


def test_the_vespo_preset_keeps_the_correction_off_where_auto_would_turn_it_on(tmp_path):
    """A bf16 sampler beside a float32 trainer: `auto` is on there (the grpo preset shows it), and the vespo
    preset's own `enabled: false` holds against the rollout correction's defaults."""
    bf16 = "perf.generate.weights=bfloat16"
    assert build(make_cfg(tmp_path, ["loss=grpo", bf16]).loss).rollout_correction.active
    cfg = make_cfg(tmp_path, ["loss=vespo", bf16])
    assert cfg.loss.rollout_correction.enabled is False
    validate(cfg, platform=False)
    assert not build(cfg.loss).rollout_correction.active


@pytest.mark.parametrize("name", sorted(_REGISTRY))
def test_each_loss_type_the_messages_name_has_its_preset_and_it_passes(tmp_path, name):
    """A message says `loss=<type>`: that preset exists, selects the type and passes the check as composed."""
    assert OmegaConf.load(CONF / f"{name}.yaml").loss_type == name
    cfg = make_cfg(tmp_path, [f"loss={name}"])
    validate(cfg, platform=False)
    assert build(cfg.loss).loss_type == name


# ---- a direct construction says the same ----------------------------------------------------------------------------
def test_a_construction_refuses_another_types_options_like_the_config(tmp_path):
    config = refusal(tmp_path, ["loss=grpo", "+loss.sapo.temperature_pos=2"])
    with pytest.raises(ValueError) as err:
        GRPOLoss(loss_type="grpo", sapo=SapoSettings(temperature_pos=2.0))
    assert str(err.value) == config
    with pytest.raises(ValueError, match=r"^loss.vespo: options of loss_type vespo, but loss.loss_type is sapo"):
        GRPOLoss(loss_type="sapo", vespo={"k_pos": 3.0})
    GRPOLoss(loss_type="grpo", sapo=SapoSettings(), vespo=VespoSettings())  # the declared defaults: nothing set


def test_a_construction_refuses_vespo_with_the_correction_on_like_the_config(tmp_path):
    config = refusal(tmp_path, ["loss=vespo", "loss.rollout_correction.enabled=true"])
    with pytest.raises(ValueError) as err:
        GRPOLoss(loss_type="vespo", rollout_correction=RolloutCorrection(enabled=True))
    assert str(err.value) == config == f"loss.rollout_correction.enabled=true {VESPO_NEEDS}"


# ---- the entropy bonus -----------------------------------------------------------------------------------------------
def test_a_negative_entropy_coef_is_refused_as_a_penalty(tmp_path):
    message = refusal(tmp_path, ["loss.entropy_coef=-0.01"])
    assert message.startswith("loss.entropy_coef must be >= 0, the weight of an entropy bonus")
    assert "penalise entropy" in message and message.endswith("(got -0.01)")
    with pytest.raises(ValueError) as err:
        GRPOLoss(entropy_coef=-0.01)
    assert str(err.value) == message


@pytest.mark.parametrize("value", [0.0, 0.01])
def test_a_zero_or_positive_entropy_coef_is_taken(tmp_path, value):
    cfg = make_cfg(tmp_path, [f"loss.entropy_coef={value}"])
    validate(cfg, platform=False)
    assert build(cfg.loss).entropy_coef == value


# ---- the command line ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["loss=grpo", "+loss.sapo.temperature_pos=2"], ["error: loss.sapo: options of loss_type sapo"]),
        (["loss=sapo", "loss.loss_type=vespo"], ["loss=vespo", "loss.rollout_correction.enabled=auto"]),
        (["loss.entropy_coef=-1"], ["error: loss.entropy_coef must be >= 0"]),
    ],
)
def test_the_cli_prints_one_line_and_exits_2(tmp_path, overrides, words):
    result = cli("dry_run=true", f"hydra.run.dir={tmp_path}/run", *overrides, cwd=tmp_path)
    assert_clean_failure(result, *words, code=2)
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1
