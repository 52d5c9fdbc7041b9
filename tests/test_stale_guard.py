"""The stale-weight guard in a real run (tiny model, CPU): quiet with the HF engine, loud with a stale one."""

import pytest

from grpo_lightning.app.train import build_run
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.types import Completion

OFFSET = 0.5
QUICK = "eval.enabled=false"


class OffsetLogprobGenerator(HFGenerator):
    """Reports every log-prob 0.5 nat lower than it sampled with: a generator that is plainly not the policy."""

    def generate(self, *args, **kwargs) -> list[list[Completion]]:
        groups = super().generate(*args, **kwargs)
        return [[Completion(c.token_ids, [x - OFFSET for x in c.logprobs], c.finished) for c in g] for g in groups]


def guard_of(run) -> StaleWeightGuard:
    (loop,) = [c for c in run.trainer.callbacks if isinstance(c, RolloutLoop)]
    assert isinstance(loop.guard, StaleWeightGuard)
    return loop.guard


def test_hf_generator_runs_clean(tiny_cfg):
    run = build_run(tiny_cfg(QUICK))
    metrics = run.fit()
    assert guard_of(run).threshold == 0.1  # grpo_lightning/conf/generator/hf.yaml
    assert guard_of(run).flagged == [] and metrics["rollout/logp_diff_mean"] < 1e-3


def test_stale_generator_is_flagged_every_round(tiny_cfg):
    run = build_run(tiny_cfg(QUICK, f"generator._target_={__name__}.OffsetLogprobGenerator"))
    run.fit()
    flagged = guard_of(run).flagged
    assert [epoch for epoch, _ in flagged] == [0, 1]
    assert all(value == pytest.approx(OFFSET, abs=1e-3) for _, value in flagged)  # |x - (x - 0.5)| = 0.5


def test_abort_stops_the_run(tiny_cfg):
    cfg = tiny_cfg(QUICK, f"generator._target_={__name__}.OffsetLogprobGenerator", "generator.on_stale=abort")
    run = build_run(cfg)
    with pytest.raises(RuntimeError, match="rollout/logp_diff_mean = 0.5"):
        run.fit()
    assert run.trainer.current_epoch == 0  # stopped after the first round


class AnotherModelGenerator(OffsetLogprobGenerator):
    """Log-probs 3 nats off, as another checkpoint's are, with the bound servers declare (generator=vllm_server)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard.another_model = 1.0

    def generate(self, *args, **kwargs) -> list[list[Completion]]:
        groups = HFGenerator.generate(self, *args, **kwargs)
        return [[Completion(c.token_ids, [x - 3.0 for x in c.logprobs], c.finished) for c in g] for g in groups]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_round_another_model_sampled_is_never_trained_on(tiny_cfg, accumulate):
    """Whatever on_stale says (warn, the default): the run stops before the round's first update, every trainable
    parameter as it was (the truth: a copy taken before fit), with one micro-batch per step or two."""
    import torch

    from grpo_lightning.errors import EngineFailed

    cfg = tiny_cfg(QUICK, f"generator._target_={__name__}.AnotherModelGenerator",
                   f"trainer.accumulate_grad_batches={accumulate}", "data.groups_per_micro_batch=1")  # fmt: skip
    run = build_run(cfg)
    before = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
    with pytest.raises(EngineFailed, match=r"round 0: rollout/logp_diff_mean = 3 before any update") as err:
        run.fit()
    assert not err.value.resumable
    after = dict(run.module.policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert run.trainer.global_step == 0
