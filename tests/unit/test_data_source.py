"""The data-source interface (`DataSource`, data/source.py): what the data module, the config check, the plan and
the model card ask a source, each answered by the source itself. The card's words and tags for the built-in
sources are written out below as they have always read."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest

from grpo_lightning.app.build import build
from grpo_lightning.app.export import model_card
from grpo_lightning.app.plan import check_model_fits
from grpo_lightning.app.validation import check_reward_fits_data
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.data.source import DataSource, Problem
from grpo_lightning.rewards.checkers import NumericChecker
from grpo_lightning.variants.baseline import BaselineGRPO
from tests.conftest import make_cfg

HERE = "tests.unit.test_data_source"


@dataclass
class Pairs(DataSource):
    """Two sums in memory, the same two on the test split; every default of the interface kept."""

    budgets: ClassVar[list[dict[str, int]]] = []
    """What the plan asked `check_prompts_fit` to fit, call by call."""

    def load(self) -> list[Problem]:
        return [Problem("What is 1 + 1?", "#### 2", "2"), Problem("What is 2 + 2?", "#### 4", "4")]

    def describe(self) -> str:
        return "two sums"

    def messages(self, question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": question}]

    def test_split(self, path=None, num_problems=None) -> Pairs:
        return self

    def checker(self, reward=None) -> NumericChecker:
        return NumericChecker()


@dataclass
class RecordedPairs(Pairs):
    gives_records: ClassVar[bool] = True


@dataclass
class BudgetedPairs(Pairs):
    def check_prompts_fit(self, tokenizer, budgets: dict[str, int]) -> None:
        type(self).budgets.append(dict(budgets))


def own_source(cls: type) -> list[str]:
    return ["~data.dataset", f"+data.dataset._target_={HERE}.{cls.__name__}"]


@pytest.mark.parametrize(
    ("overrides", "words", "tags"),
    [
        ([], "`packaged` GSM8K, split `train` (Cobbe et al. 2021)", "grpo, gsm8k, grpo_lightning"),
        (["data.dataset.source=hub", "data.dataset.split=test"], "`hub` GSM8K, split `test` (Cobbe et al. 2021)",
         "grpo, gsm8k, grpo_lightning"),
        (["data=reasoning_gym", "+data.dataset.task_config.max_digits=1", "data.dataset.size=40"],
         "reasoning-gym task `basic_arithmetic` {'max_digits': 1}, 40 problems", "grpo, reasoning-gym, grpo_lightning"),
        (["data=games", "data.dataset.size=50"], "self-play games of `tictactoe` (50 seeds; docs/selfplay.md)",
         "grpo, self-play, grpo_lightning"),
        (own_source(Pairs), "two sums", "grpo, grpo_lightning"),  # the defaults: describe(), no tag of its own
    ],
    ids=["gsm8k", "gsm8k-hub", "reasoning-gym", "games", "own"],
)  # fmt: skip
def test_the_model_card_takes_the_sources_words_and_tags(tmp_path, overrides, words, tags):
    cfg = make_cfg(tmp_path, overrides)
    card = model_card(cfg, {}, "model", None, True, tmp_path, None, BaselineGRPO(), build(cfg.data.dataset))
    assert f"| data | {words} |" in card.splitlines()
    assert f"tags: [{tags}]" in card.splitlines()


def test_the_data_module_refuses_what_is_not_a_data_source():
    with pytest.raises(ValueError, match=r"^data.dataset._target_: SimpleNamespace is not a data source: derive it"):
        RolloutDataModule(SimpleNamespace(load=list, messages=list))
    assert RolloutDataModule(Pairs()).dataset == Pairs()


def test_a_source_that_leaves_a_method_out_is_not_built():
    class NoChecker(DataSource):
        def load(self):
            return []

        def describe(self):
            return ""

        def messages(self, question):
            return []

        def test_split(self, path=None, num_problems=None):
            return self

    with pytest.raises(TypeError, match="checker"):
        NoChecker()


def test_a_reward_term_that_needs_records_asks_the_source(tmp_path):
    """reward=reasoning_gym scores with each problem's record: refused on a source that says it gives none (the
    default), accepted on one that says it does."""
    check_reward_fits_data(make_cfg(tmp_path, [*own_source(RecordedPairs), "reward=reasoning_gym"]))
    with pytest.raises(ValueError, match=r"^reward.terms.\w+ \(\w+\) scores with each problem's record .* data.dataset "
                       r"\(Pairs\) does not give"):  # fmt: skip
        check_reward_fits_data(make_cfg(tmp_path, [*own_source(Pairs), "reward=reasoning_gym"]))
    with pytest.raises(ValueError, match=r"data.dataset \(GSM8K\) does not give"):
        check_reward_fits_data(make_cfg(tmp_path, ["reward=reasoning_gym"]))
    check_reward_fits_data(make_cfg(tmp_path, ["data=reasoning_gym", "reward=reasoning_gym"]))


@pytest.mark.parametrize(
    ("overrides", "budgets"),
    [
        (["data.max_prompt_tokens=200", "eval.max_prompt_tokens=300"],
         {"data.max_prompt_tokens": 200, "eval.max_prompt_tokens": 300}),
        (["data.max_prompt_tokens=200", "eval.enabled=false"], {"data.max_prompt_tokens": 200}),
    ],
)  # fmt: skip
def test_the_plan_asks_the_source_which_prompts_must_fit(tmp_path, tokenizer, overrides, budgets):
    """Every token budget a prompt is cut to goes to the source (`check_prompts_fit`): the training one, and the
    evaluation's while evaluation is on; a source that keeps the default is asked nothing more (its prompts keep
    their last tokens)."""
    BudgetedPairs.budgets.clear()
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=None))
    cfg = make_cfg(tmp_path, overrides)
    check_model_fits(cfg, model, tokenizer, RolloutDataModule(BudgetedPairs()))
    assert BudgetedPairs.budgets == [budgets]
    check_model_fits(cfg, model, tokenizer, RolloutDataModule(Pairs()))  # the default: nothing to refuse
