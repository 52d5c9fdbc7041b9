"""Each variant says what one prompt's group is (`GroupShape`), and everything that sizes or describes a group asks
it: the plan's rollouts, the memory estimate, the keys a resume may not change and the model card. Every value
below is worked out by hand from the variant's settings."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from grpo_lightning.app.build import build
from grpo_lightning.app.export import model_card
from grpo_lightning.app.memory import ModelShape, estimate
from grpo_lightning.app.run_shape import run_shape
from grpo_lightning.data.games import GameSeeds
from grpo_lightning.training.checkpointing import check_resume_settings, fixed_settings
from grpo_lightning.variants.base import GroupShape
from grpo_lightning.variants.baseline import BaselineGRPO
from grpo_lightning.variants.selfplay import SelfPlay
from grpo_lightning.variants.storpo import STORPO, STORPOSettings
from tests.conftest import make_cfg

GRPO = ["variant=grpo", "variant.num_generations=6"]
STORPO_RUN = [
    "variant=storpo",
    "variant.completions_per_step=3",
    "variant.max_steps=2",
    "variant.fallback_generations=5",
]
SELFPLAY = ["experiment=selfplay_tictactoe", "variant.games_per_group=3", "variant.max_turns=9"]


def test_each_variant_says_its_group():
    assert BaselineGRPO(num_generations=6).group() == GroupShape(
        rollouts=6, samples="6 completions", keys=("variant.num_generations",), samples_per_prefix=6,
        shared_prompt=True,
    )  # fmt: skip
    storpo = STORPO(trees=2, completions_per_step=3, max_steps=2, fallback_generations=5).group()
    assert (storpo.rollouts, storpo.samples_per_prefix, storpo.shared_prompt) == (2 * (1 + 3 * 2), 3, True)
    assert "variant.trees" in storpo.keys and "variant.num_generations" not in storpo.keys
    plain_heavy = STORPO(trees=1, completions_per_step=1, max_steps=2, fallback_generations=8).group()
    assert (plain_heavy.rollouts, plain_heavy.samples_per_prefix) == (8, 7)  # plainly: the larger group
    selfplay = SelfPlay(games_per_group=3, max_turns=9).group()
    assert (selfplay.rollouts, selfplay.samples_per_prefix, selfplay.shared_prompt) == (3 * 5, 1, False)
    assert selfplay.keys == ("variant.games_per_group", "variant.max_turns")
    # a game whose rules bound it: TicTacToe lasts 9 moves at most, 5 of them the first mover's
    tictactoe = SelfPlay(games_per_group=3, max_turns=30).group(GameSeeds(game="tictactoe"))
    assert tictactoe.rollouts == 3 * 5 and "at most 5 a game" in tictactoe.samples
    kuhn = SelfPlay(games_per_group=3, max_turns=30).group(GameSeeds(game="kuhn_poker"))
    assert kuhn.rollouts == 3 * 2  # 3 moves at most: 2 of them the first seat's


def test_a_default_storpo_round_samples_about_what_a_default_grpo_round_does(tmp_path):
    """At the shipped defaults a STORPO prompt samples at most 2 trees x (1 + 2 continuations x 2 points) = 10
    completions' worth (docs/algorithm.md, "Counting the cost"), against GRPO's 8: a round at most 1.25x."""
    from hydra.utils import instantiate

    storpo = instantiate(make_cfg(tmp_path, ["variant=storpo"]).variant).group()
    grpo = instantiate(make_cfg(tmp_path, ["variant=grpo"]).variant).group()
    assert (storpo.rollouts, grpo.rollouts) == (10, 8)


def test_a_variant_takes_its_settings_object_or_its_keys():
    settings = STORPOSettings(min_gap=2, max_steps=3)
    assert STORPO(settings).settings == STORPO(min_gap=2, max_steps=3).settings == settings
    with pytest.raises(TypeError, match="not both"):
        STORPO(settings, min_gap=2)
    with pytest.raises(TypeError, match="unexpected keys: min_gapp"):
        STORPO(min_gapp=2)
    with pytest.raises(ValueError, match=r"variant.min_steps \(3\) must be <= variant.max_steps \(2\)"):
        STORPO(min_steps=3, max_steps=2)


@pytest.mark.parametrize(
    ("overrides", "variant", "rollouts", "key", "prefix_rows", "shared"),
    [
        (GRPO, BaselineGRPO(num_generations=6), 6, "variant.num_generations", 6, True),
        (STORPO_RUN, STORPO(trees=2, completions_per_step=3, max_steps=2, fallback_generations=5), 14,
         "variant.trees or variant.completions_per_step or variant.max_steps or variant.fallback_generations", 3,
         True),
        (SELFPLAY, SelfPlay(games_per_group=3, max_turns=9), 15, "variant.games_per_group or variant.max_turns", 1,
         False),
    ],
)  # fmt: skip
def test_the_memory_estimate_sizes_the_variants_group(tmp_path, overrides, variant, rollouts, key, prefix_rows, shared):
    cfg = make_cfg(tmp_path, [*overrides, "generator.batch_size=2", "eval.enabled=false", "data.prompts_per_round=2"])
    group = variant.group()
    run = run_shape(cfg, group, 2 * group.rollouts)
    assert (run.group_size, run.group_key, run.samples_per_prefix, run.shared_prompt) == (rollouts, key, prefix_rows,
                                                                                           shared)  # fmt: skip
    assert run.rollouts_per_round == 2 * rollouts
    assert run.hf_batch_rows == max(2, prefix_rows)  # generator.batch_size=2 rows, or one prefix's samples
    # The activations by hand: one group a micro-batch; a shared prompt runs once with perf.forward.share_prefix.
    shape = ModelShape(parameters=10**6, layers=2, hidden=8, intermediate=16, kv_width=4, vocab=50,
                       lora_parameters=100, lora_target_parameters=1000)  # fmt: skip
    run = dataclasses.replace(run, share_prefix=True, logits_chunk_tokens=None, groups_per_micro_batch=1,
                              mixed_precision=False, dtype="float32", activation_checkpointing=False)  # fmt: skip
    prompt, new = run.prompt_tokens, run.new_tokens
    tokens = prompt + rollouts * new if shared else rollouts * (prompt + new)
    per_token = 2 * (10 * 8 + 5 * 16 + 2 * 4) * 4
    (activations,) = [t for t in estimate(shape, run).cpu if t.name == "activations"]
    assert activations.bytes == tokens * per_token + tokens * 50 * 4 * 3
    assert activations.key == key


def test_a_resume_fixes_the_keys_of_the_variants_group(tmp_path):
    def checkpoint(overrides, variant):
        cfg = make_cfg(tmp_path, overrides)
        settings = fixed_settings(cfg, variant.group().keys)
        path = tmp_path / f"{variant.name}.ckpt"
        torch.save({"grpo_lightning": {"fixed_settings": settings}}, path)
        return path, settings

    grpo = BaselineGRPO(num_generations=6)
    path, settings = checkpoint(GRPO, grpo)
    assert settings["variant.num_generations"] == 6
    changed = fixed_settings(make_cfg(tmp_path, [*GRPO, "variant.num_generations=4"]), grpo.group().keys)
    with pytest.raises(ValueError, match="variant.num_generations 6 -> 4"):
        check_resume_settings(path, changed, grpo.group().keys)

    selfplay = SelfPlay(games_per_group=3, max_turns=9)
    path, settings = checkpoint(SELFPLAY, selfplay)
    assert "variant.num_generations" not in settings and settings["variant.games_per_group"] == 3
    with pytest.raises(ValueError, match="variant.games_per_group 3 -> 5"):
        more = fixed_settings(make_cfg(tmp_path, [*SELFPLAY, "variant.games_per_group=5"]), selfplay.group().keys)
        check_resume_settings(path, more, selfplay.group().keys)


@pytest.mark.parametrize(
    ("overrides", "variant", "says"),
    [
        (GRPO, BaselineGRPO(num_generations=6), "6 completions each"),
        (STORPO_RUN, STORPO(trees=2, completions_per_step=3, max_steps=2, fallback_generations=5),
         "2 x (1 completion + 3 continuations at each of up to 2 branch points) (5 completions when sampled "
         "plainly) each"),
        (SELFPLAY, SelfPlay(games_per_group=3, max_turns=9),
         f"3 games of a seed from one seat (one rollout a learner move, at most {math.ceil(9 / 2)} a game) each"),
    ],
)  # fmt: skip
def test_the_model_card_says_how_the_variant_sampled_a_group(tmp_path, overrides, variant, says):
    cfg = make_cfg(tmp_path, overrides)
    card = model_card(cfg, {}, "model", None, True, tmp_path, None, variant, build(cfg.data.dataset))
    (row,) = [line for line in card.splitlines() if line.startswith("| rounds |")]
    assert says in row
    assert f"`variant={variant.name}`" in card
