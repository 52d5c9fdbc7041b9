"""Data: GSM8K parsing, seeded prompt order, micro-batches of whole groups, per-step token counts."""

import json
import logging

import pytest

from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.data.gsm8k import GSM8K, parse_rows
from grpo_lightning.training.rollout_loop import RolloutLoop
from grpo_lightning.training.round_layout import lay_out
from grpo_lightning.types import Rollout
from tests.helpers import StubGenerator


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    _write_jsonl(
        path,
        [
            {"question": "Q1?", "answer": "step\n#### 1,000"},
            {"question": "Q2?", "answer": "no final answer line"},
            {"answer": "#### 3"},
            "not json at all",
            {"question": "Q5?", "answer": "#### abc"},
            {"question": "Q6?", "answer": "x\n#### -4"},
        ],
    )
    with caplog.at_level(logging.WARNING):
        problems = GSM8K(source="path", path=str(path)).load()
    assert [(p.question, p.answer) for p in problems] == [("Q1?", "1000"), ("Q6?", "-4")]
    assert "skipped 4 malformed" in caplog.text


def test_empty_data_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="no usable GSM8K rows"):
        GSM8K(source="path", path=str(path)).load()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"source": "web"}, "data.dataset.source"),
        ({"split": "dev"}, "data.dataset.split"),
        ({"source": "path"}, "data.dataset.path"),
        ({"prompt_template": "no placeholder"}, "data.dataset.prompt_template"),
    ],
)
def test_dataset_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GSM8K(**kwargs)


def test_packaged_splits_have_the_published_sizes():
    assert len(GSM8K(split="train").load()) == 7473
    assert len(GSM8K(split="test").load()) == 1319


def _module(n_problems=10, **kwargs):
    dm = RolloutDataModule(GSM8K(), **kwargs)
    dm.problems = parse_rows([{"question": f"Q{i}", "answer": f"#### {i}"} for i in range(n_problems)], origin="test")
    return dm


def test_round_prompts_cover_each_pass_exactly_once_and_are_reproducible():
    dm = _module(n_problems=10, prompts_per_round=4, seed=3)
    first_pass = [i for r in range(2) for i in dm.problem_indices_for_round(r)] + dm.problem_indices_for_round(2)[:2]
    assert sorted(first_pass) == list(range(10))  # rounds 0, 1 and half of 2 = one permutation of all problems
    again = _module(n_problems=10, prompts_per_round=4, seed=3)
    assert [again.problem_indices_for_round(r) for r in range(5)] == [dm.problem_indices_for_round(r) for r in range(5)]
    other_seed = _module(n_problems=10, prompts_per_round=4, seed=4)
    assert [other_seed.problem_indices_for_round(r) for r in range(3)] != [
        dm.problem_indices_for_round(r) for r in range(3)
    ]


def _rollouts(group_sizes, completion_len):
    out = []
    for g, size in enumerate(group_sizes):
        for _ in range(size):
            n = completion_len(g)
            out.append(Rollout([1, 2], list(range(3, 3 + n)), [0.0] * n, reward=0.0, group_id=g, truncated=False))
    return out


class _Tok:
    pad_token_id = 0


class _NoEngine(StubGenerator):
    """The rollout loop's engine where only its layout is under test: it never samples."""

    def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
        raise AssertionError("laying a round out samples nothing")


def _loop(dm: RolloutDataModule) -> RolloutLoop:
    return RolloutLoop(generator=_NoEngine(), variant=None, reward_fn=None, datamodule=dm, tokenizer=_Tok())


def test_micro_batches_keep_whole_groups_and_count_step_tokens():
    dm = _module(prompts_per_round=4, groups_per_micro_batch=2, num_iterations=2)
    # 4 groups of 3 samples; group g's completions have g + 1 tokens -> 3, 6, 9, 12 tokens per group.
    dm.serve(lay_out(_rollouts([3, 3, 3, 3], lambda g: g + 1), 0, 2, dm.settings, _Tok.pad_token_id))
    assert [sorted(set(mb.group_ids.tolist())) for mb in dm.micro_batches] == [[0, 1], [2, 3]]
    assert len(dm.schedule) == 4  # 2 micro-batches x 2 iterations
    # Each optimizer step (2 micro-batches) covers all groups once: 3 + 6 + 9 + 12 = 30 tokens.
    assert [mb.num_tokens_in_step for mb in dm.schedule] == [30.0] * 4


def test_groups_must_fill_micro_batches():
    dm = _module(prompts_per_round=2, groups_per_micro_batch=2)
    with pytest.raises(ValueError, match="groups_per_micro_batch"):
        lay_out(_rollouts([2, 2, 2], lambda g: 1), 0, 1, dm.settings, _Tok.pad_token_id)


@pytest.mark.parametrize("key", ["prompts_per_round", "groups_per_micro_batch", "num_iterations", "max_prompt_tokens"])
def test_datamodule_validation_names_the_key(key):
    with pytest.raises(ValueError, match=f"data.{key}"):
        RolloutDataModule(GSM8K(), **{key: 0})


def test_cut_prompts_are_reported_not_silent(tmp_path, tokenizer, caplog):
    """An over-long prompt keeps its last tokens (the instruction); the cut is counted in a warning."""
    path = tmp_path / "data.jsonl"
    _write_jsonl(
        path, [{"question": "A long question. " * 40, "answer": "#### 1"}, {"question": "Hi?", "answer": "#### 2"}]
    )
    dm = RolloutDataModule(GSM8K(source="path", path=str(path)), prompts_per_round=2, max_prompt_tokens=120)
    dm.setup("fit")
    with caplog.at_level(logging.WARNING):
        prompts = dm.prompts_for_round(0, tokenizer)
    assert sorted(len(p.prompt_ids) < p.full_length for p in prompts) == [False, True]
    assert max(len(p.prompt_ids) for p in prompts) == 120
    assert "1 of 2 prompts were longer than data.max_prompt_tokens=120" in caplog.text
