"""Variants end to end through config alone: STORPO, and a variant defined outside the package."""

from grpo_lightning.app.train import build_run
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.types import Rollout
from grpo_lightning.variants import VARIANTS, GroupShape, GRPOVariant, register_variant


@register_variant("toy_pairs")
class PairsPerPrompt(GRPOVariant):
    """Two samples per prompt, one group each: the smallest possible variant, written as a user would (no settings
    of its own)."""

    def group(self, source=None) -> GroupShape:
        return GroupShape(rollouts=2, samples="2 completions", keys=(), samples_per_prefix=2, shared_prompt=True)

    def sample_rollouts(self, generator, prompts, reward_fn, decode):
        rollouts = []
        pairs = generator.generate([p.prompt_ids for p in prompts], 2)
        for group_id, (prompt, pair) in enumerate(zip(prompts, pairs, strict=True)):
            for c in pair:
                text = decode(c.token_ids)
                reward = reward_fn(text, prompt.answer)
                rollouts.append(
                    Rollout(prompt.prompt_ids, c.token_ids, c.logprobs, reward, group_id, not c.finished, text)
                )
        return rollouts


def test_a_registered_toy_variant_trains_through_config_alone(tiny_cfg):
    assert VARIANTS["toy_pairs"] is PairsPerPrompt
    run = build_run(tiny_cfg("variant._target_=tests.test_variants.PairsPerPrompt", "~variant.num_generations"))
    rollout_callback = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
    assert isinstance(rollout_callback.sampler.variant, PairsPerPrompt)
    before = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
    metrics = run.fit()
    assert [len(mb) for mb in run.datamodule.micro_batches] == [2, 2]  # 2 prompts x 2 samples
    assert metrics["rollout/group_size_mean"] == 2.0
    after = dict(run.module.policy.named_parameters())
    assert any(not (v == after[n]).all() for n, v in before.items())


def test_storpo_trains_end_to_end_on_the_tiny_model(tiny_cfg):
    run = build_run(tiny_cfg("variant=storpo"))
    metrics = run.fit()
    assert run.trainer.global_step == 2
    for key in ("rollout/storpo_branches_mean", "rollout/storpo_fallback_frac", "rollout/group_size_mean"):
        assert key in metrics
    sizes = {}
    for mb in run.datamodule.micro_batches:
        for g in mb.group_ids.tolist():
            sizes[g] = sizes.get(g, 0) + 1
    assert metrics["rollout/logp_diff_mean"] < 1e-3
    # The default rule (uncertainty) branches every completion of two or more tokens, at min(max_steps, L - 1)
    # points, whatever its text: every group is a forest of `trees` trees of 1 + K x max_steps completions. The
    # default credit (tree) reaches the loss as per-token advantages.
    assert metrics["rollout/storpo_branched_frac"] == 1.0 and metrics["rollout/storpo_fallback_frac"] == 0.0
    assert metrics["rollout/storpo_branches_mean"] == run.cfg.variant.max_steps
    variant = run.cfg.variant
    assert all(s == variant.trees * (1 + variant.completions_per_step * variant.max_steps) for s in sizes.values())
    assert all(mb.token_advantages is not None for mb in run.datamodule.micro_batches)
    assert 0.0 < metrics["rollout/credited_token_frac"] <= 1.0


def test_dry_run_lists_the_registered_variants(tmp_path, capsys):
    from grpo_lightning.app.train import train
    from tests.conftest import make_cfg

    train(make_cfg(tmp_path / "run", ["dry_run=true", "variant=storpo"]))
    listed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("variants:"))
    assert all(name in listed for name in ("grpo", "storpo", "toy_pairs")) and "this run: storpo" in listed
