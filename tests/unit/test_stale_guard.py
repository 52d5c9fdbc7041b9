"""StaleWeightGuard on its own: thresholds, warn / abort, rounds it must not judge."""

import logging
import math

import pytest
import torch

from grpo_lightning.generation.stale_guard import StaleWeightGuard


def run_round(guard, value, epoch=3):
    """What the rollout loop does: tell the guard a round was sampled, then hand it the round's logged value."""
    guard.round_sampled()
    guard.check(epoch, None if value is None else torch.tensor(value))


def test_below_threshold_is_quiet(caplog):
    guard = StaleWeightGuard(threshold=0.05)
    with caplog.at_level(logging.WARNING):
        run_round(guard, 0.049)
    assert guard.flagged == [] and caplog.records == []


def test_above_threshold_warns_with_value_and_key(caplog):
    guard = StaleWeightGuard(threshold=0.05)
    with caplog.at_level(logging.WARNING):
        run_round(guard, 0.25, epoch=3)
    assert guard.flagged == [(3, pytest.approx(0.25))]
    (record,) = caplog.records
    assert "round 3" in record.message and "0.25" in record.message
    assert "generator.logp_diff_threshold = 0.05" in record.message


def test_abort_raises():
    with pytest.raises(RuntimeError, match="generator.on_stale=abort"):
        run_round(StaleWeightGuard(threshold=0.05, on_stale="abort"), 0.3)


def test_nan_counts_as_stale():
    guard = StaleWeightGuard(threshold=0.05)
    run_round(guard, math.nan)
    assert len(guard.flagged) == 1


def test_rounds_it_does_not_judge():
    stale_on_purpose = StaleWeightGuard(threshold=0.05, is_fresh=lambda: False)  # sync_every > 1, no push
    run_round(stale_on_purpose, 0.3)
    off = StaleWeightGuard(threshold=None)
    run_round(off, 0.3)
    no_metric = StaleWeightGuard(threshold=0.05)
    run_round(no_metric, None)
    assert stale_on_purpose.flagged == off.flagged == no_metric.flagged == []


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"threshold": 0.0}, "logp_diff_threshold"), ({"threshold": math.inf}, "logp_diff_threshold"),
     ({"on_stale": "ignore"}, "on_stale")],
)  # fmt: skip
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"generator.{key}"):
        StaleWeightGuard(**kwargs)
