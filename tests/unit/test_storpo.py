"""STORPO: step boundaries, token mapping, branching, groups and masks (expected values written by hand)."""

import pytest
import torch

from grpo_lightning.algorithm.branch_points import evenly_spaced, step_boundaries, token_boundaries
from grpo_lightning.algorithm.rollouts import collate_rollouts
from grpo_lightning.generation.base import SamplingConfig
from grpo_lightning.rewards.pipeline import pipeline_from_function
from grpo_lightning.types import Completion, Prompt
from grpo_lightning.variants.storpo import STORPO
from tests.helpers import StubGenerator

TEXT_ONLY = {"trees": 1, "step_rule": "sentence", "fallback_rule": "none", "advantage": "group"}
"""STORPO before token rules and tree credit: sentence boundaries or a plain group, one flat advantage group."""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("First step. Second step.", [12]),  # the final period has nothing after it
        ("Add them. \nThen multiply.", [11]),  # ". \n" counts as one separator
        ("It costs 3.5 dollars. Then", [22]),  # the decimal point is not a boundary
        ("$1.50. The total", []),  # a period after a digit never splits, even at a sentence end
        ("Mr. Smith has 3 apples.", [4]),  # an abbreviation followed by a capital does split
        ("e.g. 5 apples", [5]),  # ... and so does one followed by a digit
        ("no periods here", []),
        ("Done. ", []),  # boundary at the very end: no next step
        ("Step one.\nStep two.\n", [10]),
        ("Total is 5.\n\nNext", []),
        ("first. second", []),  # lowercase after the period
        ("Thus. 42 apples. So 6 left", [6, 17]),
    ],
)
def test_step_boundaries_table(text, expected):
    assert step_boundaries(text) == expected


LISTED = "To find 6 * 5:\n\n1. Multiply 6 by 5.\n2. The result is 30.\nSo 30"  # steps as lines, periods after digits


@pytest.mark.parametrize(
    ("text", "rule", "expected"),
    [
        (LISTED, "sentence", []),  # "1." and "2." follow digits, "5.\n2" and "30.\nSo" too
        (LISTED, "line", [16, 36, 57]),  # the starts of "1.", "2." and "So" (blank line and all)
        ("One line", "line", []),
        ("Ends here\n", "line", []),  # a break with no text after it is no boundary
        ("  indented\n   next", "line", [14]),  # the indentation goes with the line before
        ("First step. Second\nThird", "line", [19]),
        ("First step. Second\nThird", "both", [12, 19]),
        ("Add them.\nThen multiply.", "both", [10]),  # both rules end at the same offset: once
    ],
)
def test_step_boundaries_by_rule(text, rule, expected):
    assert step_boundaries(text, rule) == expected
    assert all(text[b - 1].isspace() and not text[b].isspace() for b in step_boundaries(text, rule))


def test_evenly_spaced():
    assert evenly_spaced([1, 2, 3], 5) == [1, 2, 3]
    assert evenly_spaced(list(range(10)), 2) == [2, 7]  # middles of [0..4] and [5..9]
    assert evenly_spaced(list(range(9)), 3) == [1, 4, 7]


def test_token_boundaries_with_a_real_tokenizer(tokenizer):
    text = "Janet has 16 eggs. She eats 3.5 of them. Then she sells 9.\nThe answer is 9."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    offsets = step_boundaries(decode(ids))
    assert offsets == [19, 41]  # "eggs. She", "them. Then"; "3.5" and "9.\nThe" follow digits
    ks = token_boundaries(ids, offsets, decode)
    assert len(ks) == 2 and ks == sorted(ks)
    for k, offset in zip(ks, offsets, strict=True):
        assert decode(ids[:k]) == text[: len(decode(ids[:k]))]  # the prefix is exactly the first k ids' text
        assert len(decode(ids[:k])) <= offset < len(decode(ids[: k + 1]))  # largest such k
        assert decode(ids[:k]).rstrip().endswith(".")


def test_token_boundaries_drop_empty_and_full_prefixes():
    decode = lambda t: "".join(chr(ord("a") + i) for i in t)  # noqa: E731  one char per token
    assert token_boundaries([0, 1, 2], [0, 1, 3, 1], decode) == [1]  # k=0 and k=3 (whole) dropped, k=1 once


class ScriptedGenerator(StubGenerator):
    """A Generator that returns scripted text (test double of an engine) and records every call.

    Prefixes that are a prompt get the prompt's scripted initial completion (one sample) or fallback samples;
    any other prefix is a branch and gets `continuation` (cut to its budget).
    """

    def __init__(self, tokenizer, initial: dict[int, str], continuation: str, max_new_tokens: int = 64):
        super().__init__(SamplingConfig(max_new_tokens=max_new_tokens))
        self.tokenizer = tokenizer
        self.initial = {p: self._ids(t) for p, t in initial.items()}
        self.continuation = self._ids(continuation)
        self.calls = []

    def _ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def generate(self, prefixes, num_samples, max_new_tokens=None):
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [self.sampling.max_new_tokens] * len(prefixes)
        self.calls.append((prefixes, num_samples, budgets))
        out = []
        for prefix, budget in zip(prefixes, budgets, strict=True):
            ids = self.initial.get(prefix[0]) if len(prefix) == 1 else self.continuation
            cut = ids[:budget]
            out.append([Completion(cut, [-0.5] * len(cut), finished=len(cut) == len(ids))] * num_samples)
        return out


def _prompts(n):
    return [Prompt(prompt_ids=[1000 + i], answer="9", question=f"q{i}", problem_index=i) for i in range(n)]


def _decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def test_groups_branch_points_and_prefix_ids(tokenizer):
    initial = {
        1000: "She has 16 eggs. She eats three. Then she sells the rest. So #### 9",  # 3 boundaries
        1001: "The answer is 7",  # no boundary -> fallback
    }
    gen = ScriptedGenerator(tokenizer, initial, continuation=" So #### 9")
    variant = STORPO(completions_per_step=2, min_steps=2, max_steps=4, fallback_generations=3, **TEXT_ONLY)
    rollouts = variant.generate_rollouts(
        gen, _prompts(2), pipeline_from_function(lambda text, ans: float("#### 9" in text)), _decoder(tokenizer)
    )

    group0 = [r for r in rollouts if r.group_id == 0]
    group1 = [r for r in rollouts if r.group_id == 1]
    assert len(group0) == 1 + 2 * 3  # 1 + K x boundaries
    assert len(group1) == 3  # fallback: fallback_generations plain samples
    init_ids = gen.initial[1000]
    branch_points = sorted({r.branch_point for r in group0 if r.branch_point})
    assert len(branch_points) == 3
    # Every branch prefix handed to the generator is exactly prompt + the initial completion's first k ids.
    _, num_samples, budgets = gen.calls[1]
    assert num_samples == 2
    assert gen.calls[1][0] == [[1000] + init_ids[:k] for k in branch_points]
    assert budgets == [64 - k for k in branch_points]
    for r in group0[1:]:
        assert r.completion_ids[: r.branch_point] == init_ids[: r.branch_point]
        assert r.completion_ids[r.branch_point :] == gen.continuation
    assert group0[0].branch_point == 0 and group0[0].completion_ids == init_ids
    assert variant.metrics["rollout/storpo_branches_mean"] == 1.5  # (3 + 0) / 2 prompts
    assert variant.metrics["rollout/storpo_fallback_frac"] == 0.5


def test_advantages_span_the_whole_group(tokenizer):
    initial = {1000: "Step one. Step two. Step three. #### 5"}  # wrong (reward 0); continuations right (1)
    gen = ScriptedGenerator(tokenizer, initial, continuation=" #### 9")
    variant = STORPO(completions_per_step=1, min_steps=1, max_steps=2, fallback_generations=2, **TEXT_ONLY)
    rollouts = variant.generate_rollouts(
        gen, _prompts(1), pipeline_from_function(lambda text, ans: float("#### 9" in text)), _decoder(tokenizer)
    )
    rewards = [r.reward for r in rollouts]
    assert rewards == [0.0, 1.0, 1.0]
    # Hand computation: mean 2/3, unbiased std sqrt(1/3); A = (r - 2/3) / (std + 1e-4).
    std = (1 / 3) ** 0.5
    expected = [(-2 / 3) / (std + 1e-4), (1 / 3) / (std + 1e-4), (1 / 3) / (std + 1e-4)]
    assert [r.advantage for r in rollouts] == pytest.approx(expected, rel=1e-6)


def test_masks_cover_exactly_the_tokens_after_each_branch_point(tokenizer):
    initial = {1000: "Step one. Step two. Step three. #### 5"}
    gen = ScriptedGenerator(tokenizer, initial, continuation=" #### 9")
    rollouts = STORPO(completions_per_step=1, min_steps=1, max_steps=2, **TEXT_ONLY).generate_rollouts(
        gen, _prompts(1), pipeline_from_function(lambda text, ans: 0.0), _decoder(tokenizer)
    )
    batch = collate_rollouts(rollouts, pad_token_id=tokenizer.pad_token_id)
    for row, r in enumerate(rollouts):
        n = len(r.completion_ids)
        expected = torch.zeros(batch.completion_mask.shape[1])
        expected[r.branch_point : n] = 1.0
        assert torch.equal(batch.completion_mask[row], expected)
    assert rollouts[0].branch_point == 0 and all(r.branch_point > 0 for r in rollouts[1:])
    assert batch.branch_points.tolist() == [r.branch_point for r in rollouts]


def test_a_listed_completion_branches_by_lines_and_falls_back_by_sentences(tokenizer, caplog):
    def run(rule: str) -> tuple[STORPO, list]:
        gen = ScriptedGenerator(tokenizer, {1000: LISTED, 1001: LISTED}, continuation=" So 30")
        variant = STORPO(trees=1,
            completions_per_step=1, min_steps=2, max_steps=4, fallback_generations=3, step_rule=rule,
            fallback_rule="none", advantage="group",
        )  # fmt: skip
        rollouts = variant.generate_rollouts(
            gen, _prompts(2), pipeline_from_function(lambda text, ans: 0.0), _decoder(tokenizer)
        )
        return variant, rollouts

    by_lines, rollouts = run("line")
    assert by_lines.metrics["rollout/storpo_fallback_frac"] == 0.0
    assert by_lines.metrics["rollout/storpo_branches_mean"] == 3.0
    assert len(rollouts) == 2 * (1 + 3)
    assert "plain groups" not in caplog.text

    by_sentences, rollouts = run("sentence")
    assert by_sentences.metrics["rollout/storpo_fallback_frac"] == 1.0
    assert len(rollouts) == 2 * 3  # plain groups of fallback_generations
    assert caplog.text.count("STORPO sampled 2 of 2 prompts as plain groups") == 1
    assert "variant.step_rule=sentence" in caplog.text
    by_sentences.generate_rollouts(
        ScriptedGenerator(tokenizer, {1000: LISTED}, continuation=""), _prompts(1),
        pipeline_from_function(lambda text, ans: 0.0), _decoder(tokenizer),
    )  # fmt: skip
    assert caplog.text.count("as plain groups") == 1  # said once a run


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"step_rule": "paragraph"}, "variant.step_rule"),
        ({"completions_per_step": 0}, "variant.completions_per_step"),
        ({"min_steps": 0}, "variant.min_steps"),
        ({"max_steps": 0}, "variant.max_steps"),
        ({"fallback_generations": 1}, "variant.fallback_generations"),
        ({"min_steps": 5, "max_steps": 2}, "variant.min_steps"),
    ],
)
def test_storpo_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        STORPO(**kwargs)
