"""The run's closing summary (app/summary.py) against hand-computed means and the last evaluation's interval."""

import pytest

from grpo_lightning.app.summary import render, summary_metrics


def test_start_end_means_and_the_last_interval():
    rounds = [(0, 0.1, 0.0), (1, 0.2, 0.5), (2, 0.3, 1.0), (3, 0.5, 1.0)]
    evals = [
        (0, {"eval/gsm8k_accuracy": 0.25, "eval/format_rate": 0.5}),
        (4, {"eval/gsm8k_accuracy": 0.5, "eval/format_rate": 1.0, "eval/gsm8k_accuracy_ci95_low": 0.34,
             "eval/gsm8k_accuracy_ci95_high": 0.66}),
    ]  # fmt: skip
    metrics = summary_metrics(rounds, evals, window=2)
    assert metrics["summary/train_reward_start"] == pytest.approx(0.15)
    assert metrics["summary/train_reward_end"] == pytest.approx(0.4)
    assert (metrics["summary/eval_gsm8k_accuracy_start"], metrics["summary/eval_gsm8k_accuracy_end"]) == (0.25, 0.5)
    assert metrics["summary/eval_gsm8k_accuracy_end_ci95_low"] == 0.34
    text = render(metrics, num_rounds=4, num_evals=2, window=2)
    assert "0.250 -> 0.500 (+0.250), 95% CI [0.340, 0.660]" in text
