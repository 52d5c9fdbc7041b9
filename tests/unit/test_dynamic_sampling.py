"""Dynamic sampling: which groups are kept, which prompts are drawn, and that a round is still whole."""

from __future__ import annotations

import pytest

from grpo_lightning.algorithm.dynamic_sampling import DynamicSampling, groups_in_order, is_informative, renumbered
from grpo_lightning.app.train import build_run
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.types import Rollout
from tests.helpers import is_even_integer


def even_answer_run(tiny_cfg, max_extra_batches: int, rounds: int):
    """A tiny-model run with dynamic sampling whose reward is 0 on every odd-answer problem."""
    return build_run(
        tiny_cfg(
            "~reward.terms.vowels",
            "+reward.terms.even._target_=tests.helpers.VowelFractionOnEvenAnswers",
            "data.dynamic_sampling.enabled=true",
            f"data.dynamic_sampling.max_extra_batches={max_extra_batches}",
            f"trainer.max_epochs={rounds}",
            "eval.enabled=false",
        )
    )


def rollout(group: int, reward: float) -> Rollout:
    return Rollout([1], [2], [0.0], reward, group, False)


def test_a_group_is_informative_exactly_when_its_rewards_differ():
    assert not is_informative([rollout(0, 0.1), rollout(0, 0.1), rollout(0, 0.1)])
    assert not is_informative([rollout(0, 0.0)])
    assert is_informative([rollout(0, 0.0), rollout(0, 0.0), rollout(0, 1e-9)])


def test_groups_come_back_in_order_and_renumbered():
    rs = [rollout(1, 0.0), rollout(0, 1.0), rollout(1, 2.0), rollout(2, 3.0)]
    groups = groups_in_order(rs, 3)
    assert [[r.reward for r in g] for g in groups] == [[1.0], [0.0, 2.0], [3.0]]
    flat = renumbered([groups[2], groups[0]])
    assert [(r.group_id, r.reward) for r in flat] == [(0, 3.0), (1, 1.0)]


@pytest.mark.parametrize("bad", [-1, 1.5, "two", True])
def test_max_extra_batches_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="data.dynamic_sampling.max_extra_batches"):
        DynamicSampling(enabled=True, max_extra_batches=bad)


def test_enabled_must_be_a_boolean():
    with pytest.raises(ValueError, match="data.dynamic_sampling.enabled"):
        DynamicSampling(enabled="yes")


def test_rounds_train_only_informative_groups_and_draw_the_next_prompts_of_the_stream(tiny_cfg):
    """The reward is 0 for every completion of a problem with an odd answer, so exactly those groups have equal
    rewards: the trained groups must be the first even-answer problems of the prompt stream, in stream order,
    and the stream position must advance by whole batches of prompts_per_round."""
    run = even_answer_run(tiny_cfg, max_extra_batches=6, rounds=2)
    callback = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
    dm = run.datamodule
    per_round = dm.settings.prompts_per_round
    trained: list[list[int]] = []
    original_serve = dm.serve

    def record(round_):
        trained.append([r.prompt_ids for r in round_.rollouts])
        return original_serve(round_)

    dm.serve = record
    metrics = run.fit()

    # Independent truth: walk the stream, batch by batch, as the rule says.
    stream = dm.problem_indices(0, 200)
    even = [is_even_integer(dm.problems[i].answer) for i in stream]
    position, expected_rounds = 0, []
    for _ in range(2):
        kept, batches = [], 0
        while len(kept) < per_round and batches <= 6:
            block = range(position, position + per_round)
            kept += [stream[k] for k in block if even[k]]
            position, batches = position + per_round, batches + 1
        expected_rounds.append((kept[:per_round], batches))
    assert callback.prompt_cursor == position
    for (expected, _), prompt_ids in zip(expected_rounds, trained, strict=True):
        expected_ids = [dm.encode(i, callback.tokenizer).prompt_ids for i in expected]
        groups = []
        for ids in prompt_ids:  # rollouts arrive group by group
            if not groups or groups[-1] != ids:
                groups.append(ids)
        assert groups == expected_ids
    assert metrics["rollout/ds_extra_batches"] == expected_rounds[-1][1] - 1
    assert metrics["rollout/ds_prompts_consumed"] == expected_rounds[-1][1] * per_round
    assert metrics["rollout/ds_groups_short"] == 0
    for mb in dm.micro_batches:  # every trained group has a non-zero advantage somewhere
        for g in mb.group_ids.unique():
            assert mb.advantages[mb.group_ids == g].abs().max() > 0


def test_a_round_that_stays_short_is_filled_with_dropped_groups(tiny_cfg):
    """With no extra batch allowed, the odd-answer groups stay in the round (zero advantage) and are counted."""
    run = even_answer_run(tiny_cfg, max_extra_batches=0, rounds=1)
    metrics = run.fit()
    dm = run.datamodule
    odd = sum(not is_even_integer(dm.problems[i].answer) for i in dm.problem_indices(0, dm.settings.prompts_per_round))
    assert metrics["rollout/ds_groups_short"] == odd
    assert metrics["rollout/ds_groups_filtered"] == odd
    assert sum(len(mb.group_ids.unique()) for mb in dm.micro_batches) == dm.settings.prompts_per_round


def test_without_dynamic_sampling_rounds_take_consecutive_blocks_of_the_stream(tiny_cfg):
    run = build_run(tiny_cfg("eval.enabled=false"))
    dm = run.datamodule
    assert [dm.problem_indices_for_round(r) for r in range(3)] == [
        dm.problem_indices(r * dm.settings.prompts_per_round, dm.settings.prompts_per_round) for r in range(3)
    ]
