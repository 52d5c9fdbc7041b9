"""Round metrics merged over ranks: names any rank reports, the absent ones left out of a name's mean."""

from grpo_lightning.algorithm.round_metrics import RolloutStats, merge_variant_metrics, round_metrics


def part(variant: dict[str, float], reward: float = 1.0, engine: dict[str, float] | None = None) -> dict:
    stats = [
        RolloutStats(reward=reward, group=g, length=4, generated=4, truncated=False, extracted=True) for g in (0, 1)
    ]
    return {"stats": stats, "rollout_s": 1.0, "variant": variant, "sampling": {}, "engine": engine or {},
            "reward_errors": 0, "credit": (4, 8)}  # fmt: skip


def test_a_name_one_rank_lacks_is_the_mean_of_the_ranks_that_report_it():
    merged = merge_variant_metrics([{"a": 1.0, "late": 0.5}, {"a": 3.0, "early": 0.25}])
    assert merged == {"a": 2.0, "late": 0.5, "early": 0.25}
    assert list(merged) == ["a", "late", "early"]  # in the order ranks first report them


def test_a_value_every_rank_reports_alike_is_kept_exactly():
    value = 0.1 + 0.2  # a float whose mean over 3 copies would round away from it
    assert merge_variant_metrics([{"x": value}] * 3)["x"] == value


def test_round_metrics_under_two_ranks_with_different_names():
    """The STORPO case: rank 1 branched no continuation in the last third."""
    metrics = round_metrics([part({"rollout/storpo_reward_late": 1.0}), part({"rollout/storpo_reward_early": 0.0})])
    assert metrics["rollout/storpo_reward_late"] == 1.0
    assert metrics["rollout/storpo_reward_early"] == 0.0
    assert metrics["rollout/credited_token_frac"] == 0.5


def test_the_engines_metrics_of_the_first_process_alone_are_logged_as_they_are():
    """A server pool's load is read by the first process only; the others report none."""
    metrics = round_metrics([part({}, engine={"server/0/preemptions": 3.0}), part({})])
    assert metrics["server/0/preemptions"] == 3.0
