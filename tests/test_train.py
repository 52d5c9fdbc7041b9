"""End to end on the tiny random model: train() for 2 rounds, what changed, what was logged."""

import logging
import os
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.train import build_run, train
from tests.conftest import TINY, make_cfg
from tests.forked_cli import cli_run

EXPECTED_SCALARS = {
    "train/loss",
    "train/reward_mean",
    "train/reward_std",
    "train/kl",
    "train/clip_ratio",
    "train/frac_zero_std_groups",
    "train/grad_norm",
    "train/lr",
    "rollout/completion_len_mean",
    "rollout/truncated_frac",
    "rollout/format_rate",
    "rollout/logp_diff_mean",
    "rollout/logp_diff_max",
    "rollout/tokens_per_s",
    "time/rollout_s",
    "time/train_s",
    "rollout/group_size_mean",
    "rollout/tokens_generated_per_prompt",
    "eval/gsm8k_accuracy",
    "eval/format_rate",
    "eval/completion_len_mean",
}


def _snapshot(module):
    return {n: (p.detach().clone(), p.requires_grad) for n, p in module.named_parameters()}


def _scalar_tags(output_dir: Path) -> set[str]:
    acc = EventAccumulator(str(output_dir / "tensorboard"))
    acc.Reload()
    return set(acc.Tags()["scalars"]), acc


def test_lora_run_trains_adapters_only_and_logs_every_metric(tiny_cfg, caplog, recwarn):
    caplog.set_level(logging.INFO)
    cfg = tiny_cfg()
    run = build_run(cfg)
    before = _snapshot(run.module.policy)
    metrics = run.fit()
    after = _snapshot(run.module.policy)
    trainable = [n for n, (_, grad) in before.items() if grad]
    assert trainable and all("lora_" in n for n in trainable)
    for name, (value, requires_grad) in before.items():
        changed = not torch.equal(value, after[name][0])
        assert changed == requires_grad, name  # every adapter moved, every base weight (the reference) did not
    tags, acc = _scalar_tags(Path(cfg.paths.output_dir))
    assert tags >= EXPECTED_SCALARS
    assert len(acc.Scalars("train/loss")) == 2  # one value per round
    assert [e.step for e in acc.Scalars("eval/gsm8k_accuracy")] == [0, 2]  # at the start and after the last round
    assert "rollout/samples" in str(acc.Tags())
    assert metrics["rollout/logp_diff_mean"] < 1e-3  # HF generator scores exactly what the trainer scores
    ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert set(ckpt["state_dict"]) == {f"policy.{n}" for n in trainable}  # frozen base weights are not saved
    assert ckpt["global_step"] == 2  # one optimizer step per round
    assert (Path(cfg.paths.output_dir) / "policy" / "adapter_config.json").is_file()
    # Quiet output: no advertising tips, no notices about other libraries' calls, no routine detail at INFO.
    noisy = ("Tip:", "weights_only", "packed_weights", "is deprecated")
    assert not [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in noisy) and r.levelno >= 20]
    ours = str(Path(__file__).resolve().parents[1] / "grpo_lightning")
    assert not [str(w.message) for w in recwarn if "deprecated" in str(w.message) or w.filename.startswith(ours)]


def test_exported_policy_loads_with_peft_and_merged_without_it(tiny_cfg):
    """A fresh base + the saved adapter, and the merged folder alone, compute the trained policy's logits."""
    from hydra.utils import instantiate
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg("trainer.max_epochs=1", "export.merged=true", "eval.num_problems=2")
    run = build_run(cfg)
    run.fit()
    policy_dir = Path(cfg.paths.output_dir) / "policy"
    base, _ = instantiate(cfg.model.source).load(torch.float32)  # same seed: the same random base weights
    ids = torch.tensor([[1, 17, 300, 42, 9]])
    with torch.no_grad():
        base_logits = base(ids).logits
        reloaded = PeftModel.from_pretrained(base, policy_dir).eval()
        trained_logits = run.module.policy.eval()(ids).logits  # the merge ran on a copy: still the adapter model
        assert torch.allclose(reloaded(ids).logits, trained_logits, atol=1e-5)
        assert not torch.allclose(base_logits, trained_logits, atol=1e-5)  # the adapter did move the policy
        merged = AutoModelForCausalLM.from_pretrained(policy_dir / "merged").eval()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(ids).logits, trained_logits, atol=1e-4)
    assert hasattr(run.module.policy, "peft_config")
    card = (policy_dir / "README.md").read_text()
    for words in (
        "random-llama",
        "`grpo`",
        "BaselineGRPO",
        "eval/gsm8k_accuracy",
        "PeftModel.from_pretrained",
        "AutoModelForCausalLM.from_pretrained",
        "from vllm import LLM",
        "merged",
        "rounds | 1 x",
    ):
        assert words in card, words
    assert "[More Information Needed]" not in card  # not peft's empty template


def test_the_perf_presets_train_the_same_first_round(tiny_cfg):
    """perf=plain (every speed lever off), perf=cpu_fast (every CPU lever on) and perf=gpu (checkpointed layers, a
    chunked head, sampling through the LoRA layers) train the same first round to float tolerance. The multinomial
    draw makes all sample the same rollouts (each lever alone: tests/unit/); SGD keeps the step proportional to the
    gradient (Adam's first step is lr * sign(g): a ~0 component's rounding flips it)."""
    from grpo_lightning.accel import ForwardSettings

    expected_levers = {
        "plain": ForwardSettings.plain(),
        "cpu_fast": ForwardSettings(),
        "gpu": ForwardSettings(
            share_prefix=False,
            logits_chunk_tokens=1024,
            runs_by_length=False,
            fused_lora=False,
            activation_checkpointing=True,
        ),  # fmt: skip
    }
    trained = {}
    for perf, levers in expected_levers.items():
        overrides = (f"perf={perf}", "perf.generate.sampler=multinomial", "trainer.max_epochs=1", "eval.enabled=false")
        overrides += ("optim.optimizer._target_=torch.optim.SGD", "~optim.optimizer.betas", "optim.optimizer.lr=0.1")
        run = build_run(tiny_cfg(*overrides))
        assert run.module.forward_settings == levers
        layers = run.module.policy.get_base_model().model.layers
        assert all(layer.gradient_checkpointing == levers.activation_checkpointing for layer in layers)
        before = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
        metrics = run.fit()
        params = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
        trained[perf] = (metrics, params, before)
    plain_metrics, plain, _ = trained["plain"]
    for perf in ("cpu_fast", "gpu"):
        metrics, params, before = trained[perf]
        assert metrics["train/reward_mean"] == plain_metrics["train/reward_mean"], perf  # the same rollouts
        assert params.keys() == plain.keys()
        for name in plain:
            assert torch.allclose(params[name], plain[name], atol=1e-6, rtol=1e-5), (perf, name)
        assert max(float((params[n] - before[n]).abs().max()) for n in params) > 1e-4  # the step moved the adapters


def test_full_finetune_keeps_a_frozen_reference(tiny_cfg):
    run = build_run(tiny_cfg("model.lora.enabled=false", "loss.beta=0.1", "trainer.max_epochs=1"))
    assert run.module.reference is not None
    ref_before = _snapshot(run.module.reference)
    pol_before = _snapshot(run.module.policy)
    run.fit()
    assert all(torch.equal(v, dict(run.module.reference.named_parameters())[n]) for n, (v, _) in ref_before.items())
    changed = [
        n for n, (v, _) in pol_before.items() if not torch.equal(v, dict(run.module.policy.named_parameters())[n])
    ]
    assert len(changed) > 0.5 * len(pol_before)


def test_beta_zero_builds_no_reference(tiny_cfg):
    run = build_run(tiny_cfg("model.lora.enabled=false", "loss.beta=0.0", "trainer.max_epochs=1"))
    assert run.module.reference is None
    assert run.module.reference_logprobs(None) is None


@pytest.mark.parametrize("loss", ["bnpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_each_loss_type_trains(tiny_cfg, loss):
    metrics = train(tiny_cfg(f"loss={loss}", "trainer.max_epochs=1"))
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


@pytest.fixture(scope="module")
def correction_off_metrics(tmp_path_factory):
    """The final metrics of a 1-round tiny run with the rollout correction as configured by default (auto: off
    with the HF engine), run once for both levels below."""
    return train(make_cfg(tmp_path_factory.mktemp("correction_off") / "run", [*TINY, "trainer.max_epochs=1"]))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_weighs_with_the_measured_generator_gap(tiny_cfg, correction_off_metrics, level):
    """On: the ratios it logs are exp(logp_old - logp_gen), the very gap `rollout/logp_diff_*` measures by its own
    path (the HF engine samples from the policy itself: a ratio of 1 up to float rounding). Off (auto, here): none
    of its metrics. Two steps per round: the old log-probs are the scored ones."""
    import math

    on = ["loss.rollout_correction.enabled=true", f"loss.rollout_correction.level={level}"]
    metrics = train(tiny_cfg(*on, "data.num_iterations=2", "trainer.max_epochs=1"))
    gap = metrics["rollout/logp_diff_max"]  # max |logp_old - logp_gen| over the round's tokens
    if level == "sequence":  # the product over a completion's tokens: at most max_new_tokens gaps
        gap *= 16
    assert math.exp(-gap) - 1e-6 <= metrics["train/is_ratio_mean"] <= math.exp(gap) + 1e-6
    assert math.exp(-gap) - 1e-6 <= metrics["train/is_ratio_max"] <= math.exp(gap) + 1e-6
    assert metrics["train/is_capped_frac"] == 0.0 and metrics["train/is_masked_frac"] == 0.0
    assert not any(key.startswith("train/is_") for key in correction_off_metrics)


def test_several_steps_per_round_use_old_logprobs_scored_before_the_update(tiny_cfg):
    run = build_run(tiny_cfg("data.num_iterations=2", "trainer.max_epochs=1"))
    metrics = run.fit()
    assert run.trainer.global_step == 2
    assert all(mb.old_logprobs is not None for mb in run.datamodule.micro_batches)
    assert metrics["rollout/logp_diff_mean"] < 1e-3


def test_dry_run_loads_no_model(tmp_path, monkeypatch):
    from grpo_lightning.models import sources as models

    def fail(*args, **kwargs):
        raise AssertionError("dry_run loaded a model")

    monkeypatch.setattr(models.RandomSource, "load", fail)
    metrics = train(make_cfg(tmp_path, ["model=tiny", "dry_run=true"]))  # GSM8K reward: references score 1
    assert metrics == {"dry_run/reference_reward_mean": 1.0}


def _cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the user's default: no traceback
    return cli_run(*args, cwd=cwd, env=env)  # forked past its imports where it can be: tests/forked_cli.py


@pytest.mark.slow
def test_cli_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    result = _cli("dry_run=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rollouts_per_round" in result.stdout and "16" in result.stdout
    assert "reference solutions score 1.0000 on 7473 problems" in result.stdout
    assert list(tmp_path.iterdir()) == []  # Hydra's outputs/<date>/<time> is removed again
    for noise in ("litlogger", "Tip:", "weights_only", "deprecated"):
        assert noise not in result.stdout + result.stderr, noise


@pytest.mark.slow
def test_cli_follows_hydra_conventions(tmp_path):
    result = _cli("--cfg", "job", "loss=dr_grpo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "loss_type: dr_grpo" in result.stdout and "scale: auto" in result.stdout


@pytest.mark.slow
def test_an_accepted_run_writes_hydras_record_and_its_log(tmp_path):
    """The run writes what Hydra would have (it no longer does: app/run_record.py): the composed config as
    composed, Hydra's node and the overrides, and the job's log; the config read back composes to the run's."""
    import yaml

    run = tmp_path / "run"
    overrides = ["model=tiny", "trainer.max_epochs=1", "generator.max_new_tokens=8", "data.prompts_per_round=2",
                 "eval.enabled=false", "trainer.enable_progress_bar=false"]  # fmt: skip
    result = _cli(f"hydra.run.dir={run}", *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) == overrides
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert config["trainer"]["max_epochs"] == 1 and config["paths"]["output_dir"] == "${hydra:runtime.output_dir}"
    assert yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]["run"]["dir"] == str(run)
    assert "round 0: reward" in (run / "__main__.log").read_text()


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_tokens_generated_total_adds_up_every_sampled_token(tiny_cfg, max_staleness):
    """Independent count: the completion tokens of every rollout sampled in each round, dynamic sampling's
    dropped groups included (its `sampled` list), summed round by round; sequential and overlapped rounds."""
    import lightning as L

    seen = []

    class Counter(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(dict(loop.round_metrics))

    run = build_run(
        tiny_cfg(
            "trainer.max_epochs=3",
            "data.dynamic_sampling.enabled=true",
            "eval.enabled=false",
            f"rollout.max_staleness={max_staleness}",
        )
    )
    loop = run.rollout_loop
    real_sample = loop.sampler.sample_informative
    sampled_tokens = []

    def counting_sample(engine, cursor, rank, world_size, group=None):
        prompts, rollouts, sampled, metrics, cursor = real_sample(engine, cursor, rank, world_size, group)
        sampled_tokens.append(sum(len(r.completion_ids) for r in sampled))
        return prompts, rollouts, sampled, metrics, cursor

    loop.sampler.sample_informative = counting_sample
    run.trainer.callbacks.append(Counter())
    run.fit()
    totals = [m["rollout/tokens_generated_total"] for m in seen]
    assert totals == [float(sum(sampled_tokens[: i + 1])) for i in range(len(totals))]
    assert len(totals) == 3 and totals[0] > 0


def test_token_budget_ends_the_run_at_the_first_round_past_it_and_evaluates_it(tiny_cfg):
    """`max_tokens_generated`: the truth is the totals the rounds logged (recorded independently, each round's own
    `rollout/tokens_generated_total`). The run must train exactly the rounds up to the first whose total reaches
    the budget (well before `trainer.max_epochs`), evaluate after that round as after a last round, and end as a
    finished run, not an interrupted one."""
    import lightning as L

    seen = []

    class Counter(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(loop.round_metrics["rollout/tokens_generated_total"])

    budget = 600  # 16 completions of at most 16 tokens a batch: a few rounds of the tiny run
    run = build_run(tiny_cfg("trainer.max_epochs=50", f"max_tokens_generated={budget}", "eval.every_n_rounds=100"))
    loop = run.rollout_loop
    run.trainer.callbacks.append(Counter())
    metrics = run.fit()
    first_past = next(i for i, total in enumerate(seen) if total >= budget)
    assert len(seen) == first_past + 1 < 50
    assert loop.tokens_generated_total == seen[-1]  # no round was sampled after the last one
    steps = [step for step, _ in run.evaluator.history]
    assert steps == [0, run.trainer.global_step]  # the start, and after the last round
    assert "eval/gsm8k_accuracy" in metrics
