"""Tests of grpo_lightning.algorithm.advantages against hand-worked numbers and a naive per-group Python loop."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from grpo_lightning.algorithm.advantages import group_advantages, zero_std_group_fraction

EPS = 1e-4

# Hand example, ids shuffled and non-contiguous, groups of sizes 3, 2, 1, 3:
#   group 7 at positions 0, 2, 5: rewards [1, 0, 2]  mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1
#   group 3 at positions 1, 4:    rewards [3, 1]     mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
#   group 9 at position 3:        reward  [4]        size 1 -> std 0, advantage 0
#   group 5 at positions 6, 7, 8: rewards [.1]*3     all equal -> advantage exactly 0
REWARDS = [1.0, 3.0, 0.0, 4.0, 1.0, 2.0, 0.1, 0.1, 0.1]
IDS = [7, 3, 7, 9, 3, 7, 5, 5, 5]
CENTRED = [0.0, 1.0, -1.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0]
GROUP_STD = [1.0, math.sqrt(2), 1.0, 0.0, math.sqrt(2), 1.0, 0.0, 0.0, 0.0]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(REWARDS), torch.tensor(IDS, dtype=torch.long)


def test_group_scaling_hand_example() -> None:
    got = group_advantages(*_inputs(), scale_rewards="group")
    expected = torch.tensor([c / (s + EPS) for c, s in zip(CENTRED, GROUP_STD, strict=True)])
    torch.testing.assert_close(got, expected)
    assert got[6:].eq(0).all()  # exactly zero for the all-equal group (no float residue / eps blow-up)
    assert got[3].item() == 0.0  # size-1 group
    assert got.dtype == torch.float32


def test_batch_scaling_hand_example() -> None:
    got = group_advantages(*_inputs(), scale_rewards="batch")
    # Batch std over all 9 rewards: mean = 12.3 / 9; unbiased std from the stdlib.
    batch_std = statistics.stdev(REWARDS)
    expected = torch.tensor([c / (batch_std + EPS) for c in CENTRED])
    torch.testing.assert_close(got, expected)


def test_none_scaling_hand_example() -> None:
    got = group_advantages(*_inputs(), scale_rewards="none")
    torch.testing.assert_close(got, torch.tensor(CENTRED))


def test_default_is_group_and_eps_is_used() -> None:
    rewards, ids = _inputs()
    torch.testing.assert_close(group_advantages(rewards, ids), group_advantages(rewards, ids, "group"))
    got = group_advantages(rewards, ids, eps=1.0)
    torch.testing.assert_close(got[:3], torch.tensor([0.0, 1.0 / (math.sqrt(2) + 1.0), -1.0 / 2.0]))


def test_zero_std_group_fraction_hand_example() -> None:
    # Groups 9 (size 1) and 5 (all 0.1) are zero-std: 2 of 4 groups.
    assert zero_std_group_fraction(*_inputs()) == pytest.approx(0.5)
    assert zero_std_group_fraction(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])) == 0.0
    assert zero_std_group_fraction(torch.tensor([1.0, 1.0]), torch.tensor([4, 4])) == 1.0
    assert zero_std_group_fraction(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == 0.0


def test_single_sample_batch_and_empty_batch() -> None:
    for mode in ("group", "batch", "none"):
        got = group_advantages(torch.tensor([3.0]), torch.tensor([0]), scale_rewards=mode)
        assert got.tolist() == [0.0]
        assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), mode).shape == (0,)


def _naive(rewards: list[float], ids: list[int], mode: str) -> list[float]:
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, ids, strict=True):
        groups.setdefault(g, []).append(r)
    batch_std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members = groups[g]
        if len(set(members)) == 1:
            out.append(0.0)
            continue
        centred = r - statistics.fmean(members)
        if mode == "group":
            centred /= statistics.stdev(members) + EPS
        elif mode == "batch":
            centred /= batch_std + EPS
        out.append(centred)
    return out


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_loop_on_random_groups(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    ids: list[int] = []
    for gid in rng.sample(range(-50, 1000), 8):
        ids += [gid] * rng.randint(1, 6)
    rng.shuffle(ids)
    rewards = [float(rng.choice([0.0, 0.5, 1.0])) + rng.random() * rng.choice([0.0, 1.0]) for _ in ids]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids), scale_rewards=mode)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(_naive(rewards, ids, mode), dtype=torch.float64))
    groups = {g: [r for r, h in zip(rewards, ids, strict=True) if h == g] for g in set(ids)}
    frac = sum(len(set(v)) == 1 for v in groups.values()) / len(groups)
    assert zero_std_group_fraction(torch.tensor(rewards), torch.tensor(ids)) == pytest.approx(frac)


def test_validation_errors() -> None:
    rewards, ids = _inputs()
    with pytest.raises(ValueError, match=r"variant\.scale_rewards .*\(got 'std'\)"):
        group_advantages(rewards, ids, scale_rewards="std")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(rewards, ids[:3])
    with pytest.raises(ValueError, match="integer"):
        group_advantages(rewards, ids.float())
    with pytest.raises(ValueError, match="eps"):
        group_advantages(rewards, ids, eps=-1.0)
    with pytest.raises(ValueError, match="group_ids"):
        zero_std_group_fraction(rewards.view(3, 3), ids.view(3, 3))
