"""The reward pipeline: terms, transforms, composition from config, error cases, and bitwise equality of the
default pipeline with the code path it replaced (GSM8KReward + group_advantages)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from grpo_lightning.algorithm.advantages import group_advantages
from grpo_lightning.algorithm.losses import GRPOLoss
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.moved_keys import check_moved_keys, check_moved_overrides
from grpo_lightning.rewards.gsm8k import AnswerFormat, GSM8KReward, OverlongPenalty
from grpo_lightning.rewards.pipeline import RewardTermError, build_reward
from grpo_lightning.rewards.transforms import (
    Clip,
    EMABaseline,
    GroupNormalize,
    Scale,
    StepDiscount,
    StepFormat,
    Ternary,
)
from grpo_lightning.types import Completion, Rollout
from grpo_lightning.variants.baseline import BaselineGRPO
from tests.conftest import make_cfg
from tests.helpers import StubGenerator

# Completions covering every GSM8K outcome: correct, wrong but formatted, no answer, other formats, ties.
TEXTS = [
    "She has 16 eggs. 16 - 3 - 4 = 9. #### 9",
    "#### 10",
    "I do not know.",
    "The answer is 9.",
    "\\boxed{9}",
    "#### 1,000",
    "So $9.00 in all. #### $9.00",
    "",
    "The answer is 8",
    "We get 18 dollars. The answer is: **18**",
    "#### 7 then #### 9",
    "#### 9 then #### 7",
]
ANSWERS = ["9", "9", "9", "9", "9", "1000", "9", "9", "9", "18", "9", "9"]


def pipeline_of(*overrides: str, tmp_path=None, loss_type: str | None = None):
    cfg = make_cfg(tmp_path or "/tmp/unused", list(overrides))
    return build_reward(cfg.reward, loss_type=loss_type or cfg.loss.loss_type, max_new_tokens=16), cfg


def node(**places):
    return OmegaConf.create(places)


def term_fn(completion, reference, **info):
    return float(len(completion) > 3)


def named_info_term(completion, reference, truncated):
    return -1.0 if truncated else 0.0


def returns_text(completion, reference):
    return "high"


def returns_nan(completion, reference):
    return math.nan


def raises_on_empty(completion, reference):
    return 1.0 / len(completion)


def group_sum(rewards, group_ids):
    return rewards.sum()


# ---- bitwise equality with today's code path ---------------------------------------------------------------
class FakeGenerator(StubGenerator):
    """Scripted completions, G per prompt (token ids are character codes, so decode is exact)."""

    def __init__(self, texts_per_prompt):
        super().__init__()
        self.texts = texts_per_prompt

    def generate(self, prompt_ids, num_samples, max_new_tokens=None):
        out = []
        for i, _ in enumerate(prompt_ids):
            texts = self.texts[i][:num_samples]
            out.append(
                [Completion([ord(c) for c in t], [-0.25] * len(t), finished=j % 3 != 2) for j, t in enumerate(texts)]
            )
        return out


def _prompts(n):
    from grpo_lightning.types import Prompt

    return [
        Prompt(prompt_ids=[1000 + i], answer=ANSWERS[i % len(ANSWERS)], question=f"q{i}", problem_index=i)
        for i in range(n)
    ]


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _plain_gsm8k_rollouts(generator, prompts, reward: GSM8KReward) -> list[Rollout]:
    """The rollouts of one round scored by `reward` alone, without the pipeline (no advantages yet)."""
    samples = generator.generate([p.prompt_ids for p in prompts], 4)
    rollouts = []
    for group_id, (prompt, completions) in enumerate(zip(prompts, samples, strict=True)):
        for c in completions:
            text = _decode(c.token_ids)
            result = reward.score_detailed(text, prompt.answer)
            rollouts.append(
                Rollout(
                    prompt_ids=list(prompt.prompt_ids),
                    completion_ids=c.token_ids,
                    gen_logprobs=c.logprobs,
                    reward=result.reward,
                    group_id=group_id,
                    truncated=not c.finished,
                    text=text,
                    answer_extracted=result.extracted is not None,
                )
            )
    return rollouts


@pytest.mark.parametrize(("loss", "scale"), [("grpo", "group"), ("dapo", "group"), ("dr_grpo", "none")])
def test_default_pipeline_is_bitwise_todays_rewards_advantages_and_loss(tmp_path, loss, scale):
    texts = [[TEXTS[(i * 5 + j) % len(TEXTS)] for j in range(4)] for i in range(6)]
    texts[1] = ["#### 9"] * 4  # a group of equal rewards: advantage exactly 0
    generator, prompts = FakeGenerator(texts), _prompts(6)

    # The plain path: GSM8KReward(0.1) on each completion, then group_advantages with the loss type's scaling.
    old = _plain_gsm8k_rollouts(generator, prompts, GSM8KReward(format_bonus=0.1))
    plain = group_advantages(torch.tensor([r.reward for r in old]), torch.tensor([r.group_id for r in old]), scale)
    for r, a in zip(old, plain.tolist(), strict=True):
        r.advantage = a
    pipeline, _ = pipeline_of(f"loss={loss}", tmp_path=tmp_path)
    new = BaselineGRPO(num_generations=4).generate_rollouts(generator, prompts, pipeline, _decode)

    assert [r.reward for r in new] == [r.reward for r in old]
    assert [r.answer_extracted for r in new] == [r.answer_extracted for r in old]
    old_adv = torch.tensor([r.advantage for r in old])
    new_adv = torch.tensor([r.advantage for r in new])
    assert torch.equal(old_adv, new_adv)
    # ... and directly against group_advantages on the rewards:
    rewards = torch.tensor([GSM8KReward(0.1)(_decode(r.completion_ids), prompts[r.group_id].answer) for r in new])
    gids = torch.tensor([r.group_id for r in new])
    assert torch.equal(new_adv, group_advantages(rewards, gids, scale))
    # The loss on identical batches is identical.
    old_batch, new_batch = collate_rollouts(old, 0), collate_rollouts(new, 0)
    assert torch.equal(old_batch.advantages, new_batch.advantages) and torch.equal(old_batch.rewards, new_batch.rewards)
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(old_batch.completion_mask.shape, generator=gen) * 0.1 - 1.0).requires_grad_()
    ref = logp.detach() + 0.05
    loss_fn = GRPOLoss(loss_type=loss, beta=0.04, max_completion_length=16)
    out_old = loss_fn(logp, logp.detach(), ref, old_batch.advantages, old_batch.completion_mask, 100)
    out_new = loss_fn(logp, logp.detach(), ref, new_batch.advantages, new_batch.completion_mask, 100)
    assert torch.equal(out_old.loss, out_new.loss)
    assert [r.reward_terms for r in new] == [{"gsm8k": r.reward} for r in new]


def test_default_pipeline_scores_every_text_as_gsm8k_reward(tmp_path):
    pipeline, cfg = pipeline_of(tmp_path=tmp_path)
    reference = GSM8KReward(format_bonus=0.1)
    for text, answer in zip(TEXTS, ANSWERS, strict=True):
        got = pipeline.score_completion(text, answer, truncated=True, num_tokens=16)
        want = reference.score_detailed(text, answer)
        assert (got.reward, got.extracted, got.correct) == (want.reward, want.extracted, want.correct)
    assert OmegaConf.select(cfg, "eval.reward.format_bonus") == 0.0  # evaluation stays correctness-only


# ---- built-in terms ------------------------------------------------------------------------------------------
def test_answer_format_and_overlong_penalty():
    assert AnswerFormat()("#### 4", "9") == 1.0 and AnswerFormat()("no answer", "9") == 0.0
    penalty = OverlongPenalty(buffer_fraction=0.25)  # L_max 100: 0 up to 75 tokens, -1 at 100
    assert penalty("x", "9", num_tokens=75, max_new_tokens=100) == 0.0
    assert penalty("x", "9", num_tokens=80, max_new_tokens=100) == pytest.approx(-0.2)
    assert penalty("x", "9", num_tokens=100, max_new_tokens=100) == -1.0
    assert penalty("x", "9", truncated=True, num_tokens=100, max_new_tokens=100) == -1.0
    assert penalty("x", "9") == 0.0  # no token count (the dry run's reference solutions)
    with pytest.raises(ValueError, match="buffer_fraction"):
        OverlongPenalty(buffer_fraction=0.0)


def test_shaped_pipeline_terms_and_logging_names(tmp_path):
    pipeline, _ = pipeline_of("reward=gsm8k_shaped", tmp_path=tmp_path)
    correct = pipeline.score_completion("#### 9", "9", truncated=False, num_tokens=4)
    assert correct.reward == pytest.approx(1.1) and correct.terms == {
        "correctness": 1.0,
        "format": 1.0,
        "overlong": 0.0,
    }
    wrong = pipeline.score_completion("#### 8", "9", truncated=False, num_tokens=4)
    assert wrong.reward == pytest.approx(0.1) and not wrong.correct and wrong.extracted == "8"
    cut = pipeline.score_completion("and so on", "9", truncated=True, num_tokens=16)  # max_new_tokens 16
    assert cut.reward == -1.0 and cut.terms["overlong"] == -1.0


# ---- transforms ------------------------------------------------------------------------------------------------
def test_per_completion_transforms():
    assert [Clip(low=-0.5, high=1.0)(x) for x in (-2.0, 0.3, 1.5)] == [-0.5, 0.3, 1.0]
    assert Clip(high=0.0)(5.0) == 0.0 and Clip()(7.0) == 7.0
    assert Scale(factor=2.0, shift=-1.0)(0.75) == 0.5
    assert [Ternary()(x) for x in (1.0, 0.1, 0.0, -3.0)] == [1.0, 0.0, -1.0, -1.0]
    for bad, match in [(lambda: Clip(low=1, high=0), "low"), (lambda: Ternary(high=0, low=1), "low"),
                       (lambda: Scale(factor=math.nan), "factor")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            bad()


def test_step_transforms():
    steps = ["We have 3 + 4 = 7 apples. ", "Then 7 * 2 = 14. ", "So the answer. ", "#### 14"]
    shaped = StepFormat(bonus=0.02, max_bonus=0.1)
    assert shaped(1.0, steps) == pytest.approx(1.04)  # two steps show a result
    assert shaped(1.0, steps, branch_step=1) == pytest.approx(1.02)  # a continuation: only its own steps
    assert StepFormat(bonus=0.5, max_bonus=0.6)(0.0, steps) == 0.6  # capped
    assert StepDiscount(gamma=0.5)(1.0, steps) == 0.125 and StepDiscount(0.5)(1.0, []) == 1.0


def test_group_normalize_matches_advantages_and_resolves_auto():
    rewards, gids = torch.tensor([1.0, 0.0, 0.1, 0.1, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    for scale in ("group", "batch", "none"):
        assert torch.equal(GroupNormalize(scale)(rewards, gids), group_advantages(rewards, gids, scale))
    auto = GroupNormalize("auto")
    auto.bind(loss_type="dr_grpo")
    assert auto.scale == "none"
    auto = GroupNormalize("auto")
    auto.bind(loss_type="grpo")
    assert auto.scale == "group"
    with pytest.raises(ValueError, match="scale must be one of group, batch, none, auto"):
        GroupNormalize("std")


def test_ema_baseline_across_rounds_and_its_state():
    ema = EMABaseline(decay=0.5)
    gids = torch.zeros(2, dtype=torch.long)
    first = ema(torch.tensor([1.0, 0.0]), gids)  # baseline starts at the first round's mean (0.5)
    assert first.tolist() == [0.5, -0.5] and ema.value == 0.5
    second = ema(torch.tensor([1.0, 1.0]), gids)  # baseline 0.5 (before the update), then 0.75
    assert second.tolist() == [0.5, 0.5] and ema.value == 0.75
    copy = EMABaseline(decay=0.5)
    copy.load_state_dict(ema.state_dict())
    third = torch.tensor([0.2, 0.9])
    assert torch.equal(copy(third, gids), ema(third, gids)) and copy.state_dict() == ema.state_dict()


# ---- composition from config -----------------------------------------------------------------------------------
def test_terms_are_weighted_then_transformed_in_order():
    pipeline = build_reward(
        node(
            terms={
                "gsm8k": {"_target_": "grpo_lightning.rewards.gsm8k.GSM8KReward", "format_bonus": 0.0, "weight": 2.0},
                "mine": {"_target_": "tests.unit.test_reward_pipeline.term_fn", "weight": -0.5},
            },
            transforms={
                "scale": {"_target_": "grpo_lightning.rewards.transforms.Scale", "factor": 2.0},
                "clip": {"_target_": "grpo_lightning.rewards.transforms.Clip", "high": 2.5},
            },
        )
    )
    result = pipeline.score_completion("#### 9", "9")  # (2 * 1 - 0.5 * 1) * 2 = 3, clipped to 2.5
    assert result.reward == 2.5 and result.terms == {"gsm8k": 1.0, "mine": 1.0}
    assert pipeline.advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0])).tolist() == [1.0, 2.0]  # no transform


def test_user_function_gets_only_the_info_it_names_and_bound_keys():
    pipeline = build_reward(node(terms={"len": {"_target_": "tests.unit.test_reward_pipeline.named_info_term"}}))
    assert pipeline("abc", "9", truncated=True, num_tokens=3) == -1.0
    bound = build_reward(
        node(terms={"penalty": {"_target_": "grpo_lightning.rewards.gsm8k.OverlongPenalty", "buffer_fraction": 0.5}}),
        max_new_tokens=10,
    )
    assert bound("x", "9", num_tokens=10) == -1.0  # max_new_tokens comes from the pipeline


def test_a_term_that_raises_scores_zero_per_term_and_is_counted(caplog):
    pipeline = build_reward(
        node(
            terms={
                "gsm8k": {"_target_": "grpo_lightning.rewards.gsm8k.GSM8KReward"},
                "flaky": {"_target_": "tests.unit.test_reward_pipeline.raises_on_empty"},
            }
        )
    )
    with caplog.at_level(logging.ERROR):
        empty = pipeline.score_completion("", "9")
        ok = pipeline.score_completion("#### 9", "9")
    assert empty.terms == {"gsm8k": 0.0, "flaky": 0.0} and ok.terms == {"gsm8k": 1.0, "flaky": 1 / 6}
    assert pipeline.pop_errors() == 1 and pipeline.pop_errors() == 0 and pipeline.total_errors == 1
    assert "reward.terms.flaky raised ZeroDivisionError" in caplog.text


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "returns_text",
            r"reward\.terms\.bad returned 'high' \(str\) for a completion; it must return a finite number",
        ),
        ("returns_nan", r"reward\.terms\.bad returned nan for a completion; it must return a finite number"),
    ],
)
def test_a_term_that_returns_a_non_number_or_nan_is_an_error_naming_it(target, message):
    pipeline = build_reward(node(terms={"bad": {"_target_": f"tests.unit.test_reward_pipeline.{target}"}}))
    with pytest.raises(RewardTermError, match=message):
        pipeline("#### 9", "9")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"terms": {}}, "reward.terms is empty"),
        ({"terms": {"x": {"_target_": "no.such.fn"}}}, r"reward\.terms\.x\._target_: cannot import 'no.such.fn'"),
        ({"terms": {"x": {"weight": 1.0}}}, r"reward\.terms\.x: needs a _target_"),
        ({"terms": {"x": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat", "weight": "a"}}},
         r"reward\.terms\.x\.weight"),
        ({"terms": {"g": {"_target_": "grpo_lightning.rewards.gsm8k.GSM8KReward", "format_bonus": 2}}},
         r"reward\.terms\.g\.format_bonus must be in \[0, 1\)"),
        ({"terms": {"total": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}}}, "reserved"),
        ({"terms": {"a": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}}, "scale_rewards": "group"},
         r"reward\.scale_rewards: unknown key"),
        ({"terms": {"a": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}}, "format_bonus": 0.2},
         r"reward\.format_bonus has moved: use reward\.terms\.gsm8k\.format_bonus"),
    ],
)  # fmt: skip
def test_config_mistakes_name_their_key(config, message):
    with pytest.raises(ValueError, match=message):
        build_reward(node(**config))


def test_a_group_transform_of_the_wrong_shape_is_an_error_naming_it():
    pipeline = build_reward(
        node(
            terms={"a": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}},
            group_transforms={"sum": {"_target_": "tests.unit.test_reward_pipeline.group_sum"}},
        )
    )
    with pytest.raises(RewardTermError, match=r"reward\.group_transforms\.sum returned \(\) for \(2,\) rewards"):
        pipeline.advantages(torch.ones(2), torch.zeros(2, dtype=torch.long))


def test_pipeline_state_round_trips_for_exact_resume():
    spec = node(
        terms={"a": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}},
        group_transforms={"ema": {"_target_": "grpo_lightning.rewards.transforms.EMABaseline", "decay": 0.8}},
    )
    first, second = build_reward(spec), build_reward(spec)
    first.advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    second.load_state_dict(first.state_dict())
    rewards, gids = torch.tensor([0.3, 0.6]), torch.tensor([0, 1])
    assert torch.equal(first.advantages(rewards, gids), second.advantages(rewards, gids))
    assert list(first.state_dict()) == ["reward.group_transforms.ema"]
    with pytest.raises(ValueError, match="reward state for reward.group_transforms.ema"):
        build_reward(node(terms={"a": {"_target_": "grpo_lightning.rewards.gsm8k.AnswerFormat"}})).load_state_dict(
            first.state_dict()
        )


# ---- old keys --------------------------------------------------------------------------------------------------
def test_old_keys_fail_with_one_line_naming_the_new_key():
    assert check_moved_overrides(["reward=gsm8k", "seed=1"]) is None
    message = check_moved_overrides(["reward.format_bonus=0.2"])
    assert (
        message.startswith("reward.format_bonus has moved: use reward.terms.gsm8k.format_bonus") and "\n" not in message
    )
    assert "reward.group_transforms.normalize.scale" in check_moved_overrides(["loss.scale_rewards=none"])
    assert "+reward.terms.<name>._target_" in check_moved_overrides(["reward._target_=my.fn"])
    assert "reward.terms.gsm8k.format_bonus" in check_moved_overrides(["~reward.format_bonus"])
    cfg = OmegaConf.create({"loss": {"scale_rewards": "batch"}, "reward": {}})
    with pytest.raises(ValueError, match=r"^loss\.scale_rewards has moved: use reward\.group_transforms"):
        check_moved_keys(cfg)


def test_step_transforms_need_a_variant_that_knows_steps(tmp_path):
    from grpo_lightning.app.train import dry_run

    cfg = make_cfg(
        tmp_path,
        [
            "model=tiny",
            "dry_run=true",
            "+reward.step_transforms.fmt._target_=grpo_lightning.rewards.transforms.StepFormat",
        ],
    )
    with pytest.raises(ValueError, match=r"reward\.step_transforms need a variant that knows reasoning steps"):
        dry_run(cfg)


class CharGenerator(StubGenerator):
    """STORPO's generator interface at character level: the initial text, then `continuation` from any prefix."""

    def __init__(self, initial: str, continuation: str):
        super().__init__(SamplingConfig(max_new_tokens=200))
        self.initial, self.continuation = initial, continuation

    def generate(self, prompt_ids, num_samples, max_new_tokens=None):
        text = self.initial if max_new_tokens is None else self.continuation
        ids = [ord(c) for c in text]
        return [[Completion(ids, [-0.1] * len(ids), finished=True)] * num_samples for _ in prompt_ids]


def test_storpo_tells_step_transforms_its_steps_and_branch_step():
    from grpo_lightning.variants.storpo import STORPO

    pipeline = build_reward(
        node(
            terms={"gsm8k": {"_target_": "grpo_lightning.rewards.gsm8k.GSM8KReward"}},
            step_transforms={
                "fmt": {"_target_": "grpo_lightning.rewards.transforms.StepFormat", "bonus": 0.25, "max_bonus": 1.0}
            },
        )
    )
    assert pipeline.uses_steps and STORPO.knows_steps and not BaselineGRPO.knows_steps
    initial = "We have 3 + 4 = 7 apples. Then 7 + 2 = 9 apples. So #### 9"  # 3 steps, 2 show a result
    variant = STORPO(
        trees=1, completions_per_step=1, min_steps=1, max_steps=2, fallback_generations=2, step_rule="sentence"
    )
    rollouts = variant.generate_rollouts(CharGenerator(initial, "So #### 9"), _prompts(1), pipeline, _decode)
    assert rollouts[0].reward == 1.5 and rollouts[0].reward_terms == {"gsm8k": 1.0}  # 1 + 2 x 0.25
    # Continuations from the 2nd and 3rd step: their own steps ("So #### 9") show no result, so no bonus.
    assert [r.reward for r in rollouts[1:]] == [1.0, 1.0] and all(r.branch_point > 0 for r in rollouts[1:])


def test_sweep_summary_shows_each_rewards_terms(tmp_path):
    import csv
    import json

    from grpo_lightning.studies.sweep import write_summary

    jobs = {
        "0_reward=gsm8k": {"train/reward_mean": 0.1, "reward/total_mean": 0.1, "reward/gsm8k_mean": 0.1},
        "1_reward=gsm8k_shaped": {
            "train/reward_mean": -0.2,
            "reward/total_mean": -0.2,
            "reward/correctness_mean": 0.0,
            "reward/format_mean": 0.5,
            "reward/overlong_mean": -0.25,
        },
    }
    for name, metrics in jobs.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(f"- {name.split('_', 1)[1]}\n")
        (tmp_path / name / "final_metrics.json").write_text(json.dumps(metrics))
    write_summary(tmp_path)
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["overrides"] for r in rows] == ["reward=gsm8k", "reward=gsm8k_shaped"]
    header = (tmp_path / "summary.md").read_text().splitlines()[0]
    assert (
        header.index("reward/total_mean") < header.index("reward/correctness_mean") < header.index("reward/gsm8k_mean")
    )
    assert rows[0]["reward/gsm8k_mean"] == "0.1" and rows[0]["reward/overlong_mean"] == ""
    assert rows[1]["reward/overlong_mean"] == "-0.25" and rows[1]["reward/format_mean"] == "0.5"
