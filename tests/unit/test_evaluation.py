"""Evaluation scoring against hand-computed values."""

import pytest

from grpo_lightning.evaluation import GSM8KEvaluator, pass_at_k, score_completions
from grpo_lightning.rewards import GSM8KReward


def test_accuracy_format_rate_and_length_on_hand_written_completions():
    texts = [
        "She sells 9 eggs.\n#### 9",  # correct
        "The answer is 18.",  # correct
        "#### 7",  # wrong, but formatted
        "I think it is 5",  # no extractable answer
        "\\boxed{1,000}",  # correct (commas)
    ]
    answers = ["9", "18", "8", "5", "1000"]
    lengths = [10, 6, 3, 7, 4]
    result = score_completions(texts, lengths, answers, GSM8KReward(format_bonus=0.0))
    assert result.accuracy == pytest.approx(3 / 5)
    assert result.format_rate == pytest.approx(4 / 5)
    assert result.completion_len_mean == pytest.approx(30 / 5)


def test_pass_at_k_by_hand():
    assert pass_at_k([[False, True], [False, False], [True, True]]) == pytest.approx(2 / 3)
    assert pass_at_k([]) == 0.0


@pytest.mark.parametrize("key", ["every_n_rounds", "num_problems", "max_new_tokens"])
def test_validation_names_the_key(key):
    with pytest.raises(ValueError, match=f"eval.{key}"):
        GSM8KEvaluator(dataset=None, reward=None, **{key: 0})
