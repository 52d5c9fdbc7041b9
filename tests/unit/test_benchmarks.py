"""The learning benchmarks (benchmarks/learning.py, benchmarks/variants.py): their pinned configs, composed as a
run composes them, and their tables on synthetic run folders whose metrics are written here (TensorBoard event
files), against hand-computed numbers. The overlap benchmark's two modes (benchmarks/overlap.py), composed. The
job runner (grpo_lightning/studies/jobs.py) on fake runs that record when they ran. benchmarks/storpo_branching.py on
the tiny model (slow tier)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter

from benchmarks import learning, overlap, selfplay, variants
from grpo_lightning.studies.analysis import EvalPoint, band, eval_points, read_run, tokens_to_target
from grpo_lightning.studies.jobs import CONF_DIR, Job, compose, run_jobs, value

RECIPES = ["learn_cpu"] + (["learn_arith"] if (CONF_DIR / "experiment" / "learn_arith.yaml").is_file() else [])
NAN = math.nan


# ---- the pinned configs -------------------------------------------------------------------------------------------
def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _leaves(child, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


@pytest.mark.parametrize("engine", sorted(overlap.ENGINES))
def test_the_overlap_benchmark_modes_differ_in_the_overlap_only(engine):
    modes = overlap.mode_overrides(engine, rounds=4, same=True, tiny=False, sampler_threads=1, extra=[])
    configs = {m: compose(overrides) for m, overrides in modes.items()}
    sequential, overlapped = (dict(_leaves(OmegaConf.to_container(configs[m]))) for m in modes)  # unresolved
    differing = {k for k in sequential.keys() | overlapped.keys() if sequential.get(k) != overlapped.get(k)}
    assert differing == {"rollout.max_staleness", "rollout.sampler_threads"}
    assert [value(configs[m], "rollout.max_staleness") for m in modes] == [0, 1]
    for cfg in configs.values():  # by hand, the pins the comparison rests on
        assert value(cfg, "variant.num_generations") == 8 and value(cfg, "generator.max_new_tokens") == 96
        assert value(cfg, "generator.temperature") == 0.7 and value(cfg, "data.dynamic_sampling.enabled") is False
        assert value(cfg, "optim.optimizer.lr") == 0 and value(cfg, "trainer.max_epochs") == 4
        target = {"vllm": "VLLMGenerator", "server": "VLLMServerGenerator", "hf": "HFGenerator"}[engine]
        assert value(cfg, "generator._target_").endswith(target)
    if engine == "vllm":  # the engine in a process of its own in both modes: overlap is the only difference
        assert [value(configs[m], "generator.engine_process") for m in modes] == [True, True]
    elif engine == "hf":
        assert all(value(cfg, "generator.seed_per_prefix") is True for cfg in configs.values())


@pytest.mark.parametrize("experiment", RECIPES)
def test_every_arm_gets_the_same_pinned_settings(experiment):
    shared = variants.pinned(budget=12_345, eval_every=3)
    configs = {a: compose(variants.arm_overrides(experiment, a, shared, [])) for a in variants.ARMS}
    for name, cfg in configs.items():
        # by hand, the settings the comparison rests on (the recipe sets some of them otherwise, e.g. eval problems)
        group = "variant.fallback_generations" if name.startswith("storpo") else "variant.num_generations"
        assert value(cfg, group) == 8, name  # G, and STORPO's for a prompt it samples plainly
        assert value(cfg, "generator.temperature") == 0.7, name
        assert value(cfg, "generator.max_new_tokens") == 48, name
        assert value(cfg, "data.prompts_per_round") == 16, name
        assert value(cfg, "max_tokens_generated") == 12_345, name
        assert value(cfg, "callbacks.rollout_loop.max_tokens_generated") == 12_345, name  # what the loop reads
        assert value(cfg, "eval.every_n_rounds") == 3, name
        assert value(cfg, "eval.num_problems") == 128, name
        assert value(cfg, "eval.max_new_tokens") == 48, name
        assert value(cfg, "optim.schedule.kind") == "constant", name
        for key, pinned in shared.items():  # and every other pin, as the script sets it
            assert value(cfg, key) == pinned, (name, key)
    assert value(configs["grpo"], "variant._target_").endswith("BaselineGRPO")
    storpo = {a: configs[a] for a in ("storpo_text", "storpo_token", "storpo_tree")}
    for cfg in storpo.values():
        assert value(cfg, "variant._target_").endswith("STORPO")
        assert value(cfg, "variant.fallback_generations") == 8  # a prompt sampled plainly: GRPO's G
        assert (value(cfg, "variant.completions_per_step"), value(cfg, "variant.min_steps")) == (2, 2)
        assert (value(cfg, "variant.max_steps"), value(cfg, "variant.min_gap")) == (4, 4)
    arms = {a: tuple(value(cfg, f"variant.{k}") for k in ("step_rule", "fallback_rule", "advantage"))
            for a, cfg in storpo.items()}  # fmt: skip
    assert arms == {
        "storpo_text": ("sentence", "none", "group"),  # as STORPO was first built
        "storpo_token": ("uncertainty", "uncertainty", "group"),
        "storpo_tree": ("uncertainty", "uncertainty", "tree"),
    }


def test_extra_overrides_reach_every_arm_and_the_printed_settings():
    shared = variants.pinned(budget=1000, eval_every=5)
    configs = {
        a: compose(variants.arm_overrides("learn_cpu", a, shared, ["generator.temperature=0.9"]))
        for a in ("grpo", "storpo_tree")
    }
    variants.check_equal(configs, list(shared))  # equal on both sides: no exit
    table = variants.settings_table(configs, ["generator.temperature", "variant.min_steps", "variant.advantage"])
    assert table.splitlines()[2:] == [
        "| `generator.temperature` | `0.9` | `0.9` |",
        "| `variant.min_steps` | `null` | `2` |",
        "| `variant.advantage` | `null` | `tree` |",
    ]


def test_check_equal_refuses_a_setting_that_differs():
    configs = {"grpo": compose(["experiment=learn_cpu", "variant=grpo"])}
    configs["storpo"] = compose(["experiment=learn_cpu", "variant=storpo", "generator.temperature=0.9"])
    with pytest.raises(SystemExit, match="generator.temperature differs"):
        variants.check_equal(configs, ["generator.temperature"])


def leaves(node, prefix=""):
    if isinstance(node, dict):
        return {k: v for key, child in node.items() for k, v in leaves(child, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


@pytest.mark.parametrize("experiment", RECIPES)
def test_the_control_differs_from_the_trained_run_in_the_learning_rate_only(experiment):
    arms = {
        arm: leaves(OmegaConf.to_container(compose([f"experiment={experiment}", "seed=1", *learning.ARMS[arm]])))
        for arm in ("trained", "control")
    }
    differ = {
        k for k in arms["trained"].keys() | arms["control"].keys() if arms["trained"].get(k) != arms["control"].get(k)
    }
    assert differ == {"optim.optimizer.lr"}
    assert arms["control"]["optim.optimizer.lr"] == 0


def test_a_recipe_that_does_not_exist_fails_in_one_line():
    with pytest.raises(ValueError, match="experiment=no_such_recipe: .*Could not find 'experiment/no_such_recipe'"):
        compose(["experiment=no_such_recipe"])


# ---- synthetic runs ------------------------------------------------------------------------------------------------
def write_run(
    run_dir: Path,
    round_tokens: dict[int, float],
    evals: dict[int, dict[str, float]],
    wall_s=None,
    fallback: list[float] | None = None,
    completion_len: list[float] | None = None,
    credited: list[float] | None = None,
    config: dict | None = None,
):
    """A finished run folder: `rollout/tokens_generated_total` at the given steps, evaluations (EVAL_TAGS names
    without `eval/`) at theirs, STORPO's `rollout/storpo_fallback_frac`, `rollout/completion_len_mean` and
    `rollout/credited_token_frac` a round if given, and the composed config (`.hydra/config.yaml`) if given.
    Values are dyadic, exact in TensorBoard's float32."""
    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for step, total in round_tokens.items():
        writer.add_scalar("rollout/tokens_generated_total", total, step)
    for step, frac in enumerate(fallback or []):
        writer.add_scalar("rollout/storpo_fallback_frac", frac, step)
    for step, length in enumerate(completion_len or []):
        writer.add_scalar("rollout/completion_len_mean", length, step)
    for step, share in enumerate(credited or []):
        writer.add_scalar("rollout/credited_token_frac", share, step)
    for step, metrics in evals.items():
        for name, v in metrics.items():
            writer.add_scalar(f"eval/{name}", v, step)
    writer.close()
    (run_dir / "final_metrics.json").write_text(json.dumps({}))
    if config is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    if wall_s is not None:
        (run_dir / "wall_s.txt").write_text(f"{wall_s}\n")


def ev(acc, low, high, strict, fmt):
    return {"accuracy": acc, "accuracy_ci95_low": low, "accuracy_ci95_high": high,
            "accuracy_strict": strict, "format_rate": fmt}  # fmt: skip


def test_evaluations_sit_at_the_tokens_of_the_rounds_before_them(tmp_path):
    """Two optimizer steps a round: rounds log at steps 1, 3, 5 (their last step), evaluations at 0 (start),
    4 (after round 1) and 6 (after round 2)."""
    write_run(tmp_path, {1: 100.0, 3: 250.0, 5: 500.0}, {0: ev(0.25, 0.125, 0.5, 0.0, 0.5), 4: {"format_rate": 0.75},
              6: ev(0.5, 0.375, 0.625, 0.25, 1.0)})  # fmt: skip
    points = eval_points(read_run(tmp_path))
    assert [(p.step, p.tokens) for p in points] == [(0, 0.0), (4, 250.0), (6, 500.0)]
    assert (points[0].accuracy, points[0].low, points[0].high, points[0].strict) == (0.25, 0.125, 0.5, 0.0)
    assert math.isnan(points[1].accuracy) and points[1].format_rate == 0.75  # not logged: NaN, not a hole
    assert (points[2].accuracy, points[2].strict, points[2].format_rate) == (0.5, 0.25, 1.0)


def pts(*pairs):
    return [EvalPoint(i, t, a, NAN, NAN, NAN, NAN) for i, (t, a) in enumerate(pairs)]


def test_tokens_to_target_interpolates_the_first_crossing():
    points = pts((0, 0.125), (1000, 0.25), (2000, 0.5), (3000, 0.25), (4000, 0.75))
    assert tokens_to_target(points, 0.375) == 1500.0  # halfway between 1000 (0.25) and 2000 (0.5): first crossing
    assert tokens_to_target(points, 0.5) == 2000.0  # reached exactly at an evaluation
    assert tokens_to_target(points, 0.625) == 3750.0  # 3000 (0.25) to 4000 (0.75): 3/4 of the way
    assert tokens_to_target(points, 0.125) == 0.0  # the start is already there
    assert tokens_to_target(points, 0.875) is None
    assert tokens_to_target(pts((0, 0.0), (1000, NAN), (3000, 0.5)), 0.25) == 1500.0  # a missing value is skipped


def test_band_interpolates_onto_the_common_tokens():
    grid, mean, low, high = band([[(0, 0.0), (100, 1.0)], [(0, 0.0), (50, 1.0), (200, 1.0)]])
    assert grid == [0, 50, 100]  # up to the shorter curve's end
    assert (mean, low, high) == ([0.0, 0.75, 1.0], [0.0, 0.5, 1.0], [0.0, 1.0, 1.0])


def learning_runs(out: Path, with_control: bool) -> None:
    """Seed 0 clearly ahead of its control; seed 1 gains, but its interval reaches below the control."""
    start = ev(0.25, 0.125, 0.375, 0.125, 0.5)
    rounds = {0: 1000.0, 1: 2000.0, 2: 3000.0}
    write_run(out / "trained_seed0", rounds, {0: start, 3: ev(0.5, 0.375, 0.625, 0.375, 0.875)}, wall_s=120)
    write_run(out / "trained_seed1", rounds, {0: start, 3: ev(0.375, 0.25, 0.5, 0.25, 0.75)}, wall_s=90)
    if with_control:
        write_run(out / "control_seed0", rounds, {0: start, 3: start}, wall_s=60)
        write_run(out / "control_seed1", rounds, {0: start, 3: start}, wall_s=60)


@pytest.mark.parametrize("from_start", [False, True], ids=["control runs", "control from start"])
def test_learning_tables_by_hand(tmp_path, from_start, capsys):
    learning_runs(tmp_path, with_control=not from_start)
    argv = ["--experiment", "learn_cpu", "--seeds", "0", "1", "--out", str(tmp_path)]
    assert learning.main(argv + (["--control-from-start"] if from_start else [])) == 0
    assert "trained_seed0: finished before, reading it" in capsys.readouterr().out  # read, not rerun
    text = (tmp_path / "learning.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert (
        "| trained | 0 | 0.250 [0.125, 0.375] | 0.125 | 0.500 | 0.500 [0.375, 0.625] | 0.375 | 0.875 | 3000 | 2.0 |"
        in rows
    )
    assert (
        "| trained | 1 | 0.250 [0.125, 0.375] | 0.125 | 0.500 | 0.375 [0.250, 0.500] | 0.250 | 0.750 | 3000 | 1.5 |"
        in rows
    )
    label = "control (trained run's start)" if from_start else "control (lr=0)"
    gap_rows = rows[rows.index(next(r for r in rows if label + " pass@1" in r)) + 1 :]
    assert gap_rows == [
        "| 0 | 0.500 [0.375, 0.625] | 0.250 | +0.250 | +0.250 | +0.375 | yes |",  # low 0.375 > 0.25
        "| 1 | 0.375 [0.250, 0.500] | 0.250 | +0.125 | +0.125 | +0.250 | no |",  # low 0.25, not above 0.25
        "| mean | | | +0.188 | +0.188 | +0.312 | |",
    ]
    assert "every seed ahead of its control: no (1 of 2)" in text
    assert "Test: ahead = the trained run's 95% Wilson interval on its final pass@1 lies wholly above" in text
    assert ("control: not run" in text) == from_start
    if not from_start:
        assert (
            "| control | 0 | 0.250 [0.125, 0.375] | 0.125 | 0.500 | 0.250 [0.125, 0.375] | 0.125 | 0.500 | 3000 | 1.0 |"
            in rows
        )
    assert (tmp_path / "learning.png").stat().st_size > 0


def test_overlapped_against_sequential_is_a_paired_difference_by_hand(tmp_path):
    """Two seeds, 4 problems each, read from each run's last `eval_replies` file. Seed 0: sequential right on
    [1, 1, 0, 0], overlapped on [1, 0, 1, 1]: differences [0, -1, 1, 1], mean 0.25, sample sd sqrt(11/12); seed 1
    equal answers: difference 0 with no spread. Pooled, the 8 pairs: mean 0.125."""
    import json

    def replies(run: str, correct: list[int], step: int = 3) -> None:
        folder = tmp_path / run / "eval_replies"
        folder.mkdir(parents=True)
        (folder / "step_0.jsonl").write_text('{"correct": false}\n' * len(correct))  # an earlier evaluation
        (folder / f"step_{step}.jsonl").write_text("".join(json.dumps({"correct": bool(c)}) + "\n" for c in correct))

    replies("trained_seed0", [1, 1, 0, 0])
    replies("overlap_seed0", [1, 0, 1, 1], step=12)  # "step_12" sorts after "step_3" by number, not by text
    replies("trained_seed1", [0, 1, 0, 1])
    replies("overlap_seed1", [0, 1, 0, 1])
    dirs = {arm: {s: tmp_path / f"{arm}_seed{s}" for s in (0, 1)} for arm in ("trained", "overlap")}
    text = learning.overlap_table(dirs["trained"], dirs["overlap"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| seed")]
    half0 = 1.959964 * math.sqrt(11 / 12 / 4)  # d = [0, -1, 1, 1]: mean 1/4, sum of squares 11/4, / 3
    d = [0, -1, 1, 1, 0, 0, 0, 0]
    half = 1.959964 * math.sqrt(sum((x - 0.125) ** 2 for x in d) / 7 / 8)
    assert rows == [
        f"| 0 | 4 | 0.500 | 0.750 | +0.250 [{-half0 + 0.25:+.3f}, {half0 + 0.25:+.3f}] |",
        "| 1 | 4 | 0.500 | 0.500 | +0.000 [+0.000, +0.000] |",
        f"| all | 8 | 0.500 | 0.625 | **+0.125** [{0.125 - half:+.3f}, {0.125 + half:+.3f}] |",
    ]
    assert f"(the interval's low end above -0.05): {'yes' if 0.125 - half > -0.05 else 'no'}" in text


def game_eval(win, win_low, win_high, illegal, illegal_low, illegal_high):
    return {"win_rate_vs_random": win, "win_rate_vs_random_ci95_low": win_low,
            "win_rate_vs_random_ci95_high": win_high, "win_rate_vs_base": 0.5, "win_rate_vs_base_ci95_low": 0.25,
            "win_rate_vs_base_ci95_high": 0.75, "illegal_move_rate": illegal,
            "illegal_move_rate_ci95_low": illegal_low, "illegal_move_rate_ci95_high": illegal_high}  # fmt: skip


GAMES_CONFIG = {"data": {"prompts_per_round": 4}, "variant": {"games_per_group": 4}}
"""16 games a round: an evaluation at step 2 comes after 32 training games."""


def selfplay_run(run_dir, evals, wall_s, train=None, game=None):
    """A finished self-play run of GAMES_CONFIG; `train` and `game`: `train/<name>` and `game/<name>` values at
    rounds 0, 1, ... by name."""
    write_run(run_dir, {0: 10.0, 1: 20.0}, evals, wall_s=wall_s, config=GAMES_CONFIG)
    logged = {f"train/{name}": values for name, values in (train or {}).items()}
    logged |= {f"game/{name}": values for name, values in (game or {}).items()}
    if logged:
        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        for tag, values in logged.items():
            for step, value in enumerate(values):
                writer.add_scalar(tag, value, step)
        writer.close()


def test_selfplay_tables_by_hand(tmp_path, capsys):
    """Seed 0: an lr=0 run, the win rate up beyond its interval, the illegal rate down but not beyond; seed 1: no
    control run (its start), both beyond; a `rae` run that meets both play targets (0.85 >= 0.80 with its low end
    0.75 above 0.611; loss vs tactic 0.5, its whole interval below 0.886) and a `last_move` run whose loss vs tactic
    (0.85 [0.75, 0.93]) is below 0.886 by its rate only. The curve: the rates at 0 and 32 games (2 rounds of 16)."""
    start = game_eval(0.125, 0.0625, 0.25, 0.5, 0.375, 0.625) | {
        "loss_rate_vs_tactic": 1.0, "loss_rate_vs_tactic_ci95_low": 0.875, "loss_rate_vs_tactic_ci95_high": 1.0,
    }  # fmt: skip
    # the trained runs log what GRPO had to learn from at rounds 0 and 1, and a value at step 2 that belongs to the
    # rounds after the evaluation there: the evaluation at step 2 reports the means over rounds 0 and 1
    signal0 = {"frac_zero_std_groups": [0.0, 0.5, 1.0], "grad_norm": [0.75, 0.25, 0.0]}
    signal1 = {"frac_zero_std_groups": [0.25, 0.75, 1.0], "grad_norm": [0.125, 0.125, 0.0]}
    selfplay_run(tmp_path / "trained_seed0", {0: start, 2: game_eval(0.5, 0.375, 0.625, 0.375, 0.25, 0.5)}, 600,
                 signal0)  # fmt: skip
    selfplay_run(tmp_path / "control_seed0", {0: start, 2: start}, 600)
    selfplay_run(tmp_path / "trained_seed1", {0: start, 2: game_eval(0.375, 0.25, 0.5, 0.25, 0.125, 0.375)}, 480,
                 signal1)  # fmt: skip
    strong = game_eval(0.85, 0.75, 0.92, 0.0, 0.0, 0.05) | {
        "win_rate_vs_random_first": 0.9, "win_rate_vs_random_first_ci95_low": 0.8,
        "win_rate_vs_random_first_ci95_high": 0.95, "loss_rate_vs_tactic": 0.5,
        "loss_rate_vs_tactic_ci95_low": 0.4, "loss_rate_vs_tactic_ci95_high": 0.6,
    }  # fmt: skip
    selfplay_run(tmp_path / "rae_seed1", {0: start, 2: strong}, 540)
    level = game_eval(0.5, 0.375, 0.625, 0.0, 0.0, 0.05) | {
        "loss_rate_vs_tactic": 0.85, "loss_rate_vs_tactic_ci95_low": 0.75, "loss_rate_vs_tactic_ci95_high": 0.93,
    }  # fmt: skip
    selfplay_run(tmp_path / "last_move_seed1", {0: start, 2: level}, 540)
    args = ["--arms", "trained", "rae", "last_move", "--seeds", "1", "--control", "start", "--out", str(tmp_path)]
    assert selfplay.main(args) == 0
    assert "trained_seed1: finished before, reading it" in capsys.readouterr().out
    text = (tmp_path / "selfplay.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert "| 0 | trained | 0.125 [0.062, 0.250] -> 0.500 [0.375, 0.625] | n/a | n/a | n/a | 0.500 [0.250, 0.750] | " \
           "0.500 [0.375, 0.625] -> 0.375 [0.250, 0.500] | 10.0 min |" in rows  # fmt: skip
    assert "| 1 | rae | 0.125 [0.062, 0.250] -> 0.850 [0.750, 0.920] | 0.900 [0.800, 0.950] | n/a | " \
           "0.500 [0.400, 0.600] | 0.500 [0.250, 0.750] | 0.500 [0.375, 0.625] -> 0.000 [0.000, 0.050] | 9.0 min |" \
           in rows  # fmt: skip
    # win: 0.375 > 0.125; no loss vs tactic at the end; illegal: 0.5 not below 0.5
    assert "| 0 | trained | lr=0 | +0.375 | yes | n/a | n/a | -0.125 | no | no | n/a |" in rows
    assert "| 1 | trained | start | +0.250 | yes | n/a | n/a | -0.250 | yes | no | n/a |" in rows  # 0.375 < 0.5
    assert "| 1 | rae | start | +0.725 | yes | -0.500 | yes | -0.500 | yes | yes | yes |" in rows  # 0.6 < 1.0
    assert "| 1 | last_move | start | +0.375 | yes | -0.150 | yes | -0.500 | yes | no | rate only |" in rows
    assert "seed 0: every evaluation of the lr=0 run equals the trained runs' start-of-run evaluation" in text
    assert "targets: win vs random >= 0.80" in text  # the default experiment's game is TicTacToe
    curve = text[text.index("| arm | games trained on") :].split("\n\n")[0].splitlines()[2:]
    assert (
        curve
        == [  # the groups alike and the gradient norm: n/a before the first round, and for rae, which logs none
            "| trained | 0 | 0, 1 | 0.125, 0.125 | 0.125 | 1.000, 1.000 | 1.000 | n/a | n/a |",
            "| trained | 32 | 0, 1 | 0.500, 0.375 | 0.438 | n/a | n/a | 0.250, 0.500 | 0.500, 0.125 |",  # 0.4375
            "| rae | 0 | 1 | 0.125 | 0.125 | 1.000 | 1.000 | n/a | n/a |",
            "| rae | 32 | 1 | 0.850 | 0.850 | 0.500 | 0.500 | n/a | n/a |",
            "| last_move | 0 | 1 | 0.125 | 0.125 | 1.000 | 1.000 | n/a | n/a |",
            "| last_move | 32 | 1 | 0.500 | 0.500 | 0.850 | 0.850 | n/a | n/a |",
        ]
    )
    assert (tmp_path / "selfplay.png").stat().st_size > 0


def test_selfplay_chips_table_by_hand(tmp_path):
    """A game with a payoff (Kuhn Poker): the mean chips a hand against random rose from -0.1 to +0.3, its interval
    [0.2, 0.4] wholly above the lr=0 control's -0.1; against perfect from -0.2 to -0.15, [-0.3, 0.0] not above."""
    chips = {
        "payoff_vs_random": -0.1,
        "payoff_vs_random_ci95_low": -0.2,
        "payoff_vs_random_ci95_high": 0.0,
        "payoff_vs_perfect": -0.2,
        "payoff_vs_perfect_ci95_low": -0.3,
        "payoff_vs_perfect_ci95_high": -0.1,
    }
    start = game_eval(0.5, 0.4, 0.6, 0.2, 0.1, 0.3) | chips
    end = game_eval(0.6, 0.5, 0.7, 0.0, 0.0, 0.05) | {
        "payoff_vs_random": 0.3, "payoff_vs_random_ci95_low": 0.2, "payoff_vs_random_ci95_high": 0.4,
        "payoff_vs_perfect": -0.15, "payoff_vs_perfect_ci95_low": -0.3, "payoff_vs_perfect_ci95_high": 0.0,
    }  # fmt: skip
    selfplay_run(tmp_path / "trained_seed0", {0: start | {"exploitability": 0.5}, 2: end | {"exploitability": 0.25}},
                 300)  # fmt: skip
    selfplay_run(tmp_path / "control_seed0", {0: start | {"exploitability": 0.5}, 2: start | {"exploitability": 0.5}},
                 300)  # fmt: skip
    selfplay_run(tmp_path / "trained_seed1", {0: start | {"exploitability": 0.5}, 2: end | {"exploitability": 0.375}},
                 300)  # fmt: skip
    # seed 0's finished lr=0 run is its control either way; seed 1 has none: its start
    args = ["--experiment", "selfplay_kuhn", "--seeds", "0", "1", "--control", "start", "--out", str(tmp_path)]
    assert selfplay.main(args) == 0
    rows = [line for line in (tmp_path / "selfplay.md").read_text().splitlines() if line.startswith("| ")]
    assert "| 0 | trained | lr=0 | -0.100 [-0.200, 0.000] -> 0.300 [0.200, 0.400] | yes | " \
           "-0.200 [-0.300, -0.100] -> -0.150 [-0.300, 0.000] | no |" in rows  # fmt: skip
    # exploitability: 0.25 is below the simple rules' 1/3, 0.375 is not; seed 1's control is its own start (0.5)
    assert "| 0 | trained | lr=0 | 0.500 -> 0.250 | -0.250 | yes |" in rows
    assert "| 1 | trained | start | 0.500 -> 0.375 | -0.125 | no |" in rows
    # TicTacToe's play targets (the lowest-free-cell rule's rates) are not a poker game's: no verdict, no legend
    assert "| 0 | trained | lr=0 | +0.100 | no | n/a | n/a | -0.200 | yes | n/a | n/a |" in rows
    assert "targets:" not in (tmp_path / "selfplay.md").read_text()


def test_selfplay_spread_by_halves_of_the_rounds(tmp_path):
    """The spread table: each metric's mean over the first half of the rounds (0, 1) and the second (2, 3, 4): 5
    rounds, the middle one in the second half. A lever arm reads like any other; a run that logged no spread has
    no table."""
    start = game_eval(0.125, 0.0625, 0.25, 0.5, 0.375, 0.625)
    end = game_eval(0.5, 0.375, 0.625, 0.0, 0.0, 0.05)
    spread = {"move_entropy": [1.0, 0.5, 0.25, 0.25, 1.0], "groups_alike_frac": [0.75, 0.25, 0.5, 0.5, 0.5]}
    selfplay_run(tmp_path / "entropy_seed0", {0: start, 2: end}, 300, game=spread)
    selfplay_run(tmp_path / "trained_seed0", {0: start, 2: end}, 300)
    args = ["--arms", "trained", "entropy", "--seeds", "0", "--control", "start", "--out", str(tmp_path)]
    assert selfplay.main(args) == 0
    text = (tmp_path / "selfplay.md").read_text()
    assert "| 0 | entropy | 0.750 / 0.500 | 0.500 / 0.500 |" in text.splitlines()
    assert "| 0 | trained | - / - | - / - |" in text.splitlines()
    selfplay_run(tmp_path / "none" / "trained_seed0", {0: start, 2: end}, 300)
    assert selfplay.main(["--seeds", "0", "--control", "start", "--out", str(tmp_path / "none")]) == 0
    assert "The spread" not in (tmp_path / "none" / "selfplay.md").read_text()


def test_spread_levers_compose_alone_and_together():
    """Each lever arm changes only its own keys of the recipe, and `levers` sets all of them."""
    from grpo_lightning.studies.jobs import compose

    recipe = compose(["experiment=selfplay_tictactoe"])
    arms = {arm: compose(["experiment=selfplay_tictactoe", *selfplay.ARMS[arm]]) for arm in selfplay.SPREAD_LEVERS}
    arms["levers"] = compose(["experiment=selfplay_tictactoe", *selfplay.ARMS["levers"]])
    assert arms["shuffled"].data.dataset.game == "tictactoe_shuffled" and recipe.data.dataset.game == "tictactoe"
    assert arms["entropy"].loss.entropy_coef == 0.01 and recipe.loss.entropy_coef == 0.0
    assert arms["kl"].loss.beta == 0.04 and recipe.loss.beta == 0.0
    assert list(arms["noisy_opponents"].variant.fixed_opponents) == ["random", "tactic", "perfect"]
    assert arms["noisy_opponents"].variant.scripted_epsilon == 0.3 and recipe.variant.scripted_epsilon == 0.0
    for arm in selfplay.SPREAD_LEVERS:
        assert arms[arm].loss.entropy_coef == (0.01 if arm == "entropy" else 0.0)
        assert arms[arm].loss.beta == (0.04 if arm == "kl" else 0.0)
    every = arms["levers"]
    assert every.data.dataset.game == "tictactoe_shuffled" and every.variant.scripted_epsilon == 0.3
    assert (every.loss.entropy_coef, every.loss.beta) == (0.01, 0.04)
    kuhn = compose(["experiment=selfplay_kuhn", *selfplay.ARMS["loss_levers"]])
    assert (kuhn.loss.entropy_coef, kuhn.loss.beta, kuhn.data.dataset.game) == (0.01, 0.04, "kuhn_poker")


def test_the_control_from_the_start_is_flat_over_the_trained_run(tmp_path):
    learning_runs(tmp_path, with_control=False)
    dirs = {"trained": {0: tmp_path / "trained_seed0", 1: tmp_path / "trained_seed1"}}
    control = learning.curves(dirs, from_start=True)[learning.FROM_START]
    assert [[(p.tokens, p.accuracy, p.low) for p in seed] for seed in control] == [
        [(0.0, 0.25, 0.125), (3000.0, 0.25, 0.125)]
    ] * 2


def variants_runs(out: Path, storpo_fallback: tuple[list[float], list[float]] = ([0.75, 0.25], [1.0, 1.0])) -> None:
    """Evaluations every few rounds; grpo's rounds cost 1000 tokens, storpo_tree's 750. STORPO sampled plainly 3/4,
    then 1/4 of seed 0's prompts (branched from 1/4, then 3/4: 1/2 on average), and every prompt of seed 1
    (branched from none). Completion lengths: grpo 20 and 30 tokens a round (seed 0), 40 (seed 1); storpo 10, 12.

    grpo seed 0: 0.125 @0, 0.25 @2000, 0.5 @4000, 0.5 @5000 (end) -> 0.375 at 3000
    grpo seed 1: 0.125 @0, 0.375 @2000, 0.375 @4000, 0.5 @5000   -> 0.375 at 2000
    storpo seed 0: 0.125 @0, 0.25 @1500, 0.5 @3000, 0.625 @4500, 0.625 @5250 -> 0.375 at 2250
    storpo seed 1: 0.125 @0, 0.25 @1500, 0.25 @3000, 0.25 @4500, 0.25 @5250  -> not reached
    """
    grpo_rounds = {i: 1000.0 * (i + 1) for i in range(5)}
    storpo_rounds = {i: 750.0 * (i + 1) for i in range(7)}

    def e(acc, fmt=0.75):
        return ev(acc, acc - 0.125, acc + 0.125, acc / 2, fmt)

    write_run(out / "grpo_seed0", grpo_rounds, {0: e(0.125), 2: e(0.25), 4: e(0.5), 5: e(0.5)}, wall_s=600,
              completion_len=[20.0, 30.0], credited=[0.5, 0.25])  # fmt: skip
    write_run(out / "grpo_seed1", grpo_rounds, {0: e(0.125), 2: e(0.375), 4: e(0.375), 5: e(0.5)}, wall_s=660,
              completion_len=[40.0], credited=[0.625])  # fmt: skip
    write_run(out / "storpo_tree_seed0", storpo_rounds,
              {0: e(0.125), 2: e(0.25), 4: e(0.5), 6: e(0.625), 7: e(0.625)},
              wall_s=540, fallback=storpo_fallback[0], completion_len=[10.0], credited=[0.75])  # fmt: skip
    write_run(out / "storpo_tree_seed1", storpo_rounds,
              {0: e(0.125), 2: e(0.25), 4: e(0.25), 6: e(0.25), 7: e(0.25)},
              wall_s=480, fallback=storpo_fallback[1], completion_len=[12.0], credited=[1.0])  # fmt: skip


ARMS_ARGV = ["--experiment", "learn_cpu", "--arms", "grpo", "storpo_tree", "--seeds", "0", "1"]


def test_variants_tables_by_hand(tmp_path, capsys):
    variants_runs(tmp_path)
    argv = [*ARMS_ARGV, "--budget", "5000", "--target", "0.375"]
    assert variants.main([*argv, "--out", str(tmp_path)]) == 0
    assert "grpo_seed0: finished before, reading it" in capsys.readouterr().out
    text = (tmp_path / "variants.md").read_text()
    assert "| `max_tokens_generated` | `5000` | `5000` |" in text  # the settings, as composed
    assert "| `variant.num_generations` | `8` | `null` |" in text  # each variant's own group key
    assert "| `variant.fallback_generations` | `null` | `8` |" in text
    assert "| `variant.advantage` | `null` | `tree` |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| grpo", "| storpo"))]
    assert rows == [
        # tokens to 0.375: grpo (3000 + 2000) / 2; storpo: seed 1 never; final pass@1 mean, interval envelope;
        # branched: the lowest round of both seeds is 0 (seed 1), the mean of (1/4, 3/4, 0, 0) is 1/4;
        # trained tokens credited: the mean of each run's round mean, (0.375 + 0.625) / 2 and (0.75 + 1) / 2;
        # completion tokens: the mean of each run's round mean, (25 + 40) / 2 and (10 + 12) / 2
        "| grpo | 2 | 2500 | 0.500 | [0.375, 0.625] | n/a | 0.500 | 32.5 |",
        "| storpo_tree | 2 | not reached (1 of 2 seeds did) | 0.438 | [0.125, 0.750] | 0.000 / 0.250 | 0.875 | 11.0 |",
        # paired by seed: 0.625 - 0.5 and 0.25 - 0.5; mean -0.0625, sd 0.1875 sqrt 2, t(1) 12.706:
        # -0.0625 -+ 12.706 x 0.1875
        "| storpo_tree | +0.125, -0.250 | -0.062 | [-2.445, +2.320] | 1 / 0 / 1 |",
        # gained from the start (0.125) per 10,000 tokens: grpo 0.375 / 0.5 = 0.75 on both seeds, storpo 0.5 / 0.525
        # and 0.125 / 0.525; the two differences 0.375 / 0.525 apart: the mean -+ 12.706 x 0.375 / 0.525 / 2
        "| storpo_tree | 10,000 generated tokens | +0.2024, -0.5119 | -0.1548 | [-4.6926, +4.3831] | 1 / 0 / 1 |",
        # per optimizer step: grpo 0.375 / 5 = 0.075, storpo 0.5 / 7 and 0.125 / 7; -+ 12.706 x 0.375 / 7 / 2
        "| storpo_tree | optimizer step | -0.0036, -0.0571 | -0.0304 | [-0.3707, +0.3100] | 0 / 0 / 2 |",
        # optimizer steps: the last round's step + 1, the final evaluation's step (grpo 5 rounds, storpo 7)
        "| grpo | 0 | 4 | 5000 | 5 | 0.500 [0.375, 0.625] | 0.250 | 0.750 | 3000 | n/a | 0.375 | 25.0 | 10.0 |",
        "| grpo | 1 | 4 | 5000 | 5 | 0.500 [0.375, 0.625] | 0.250 | 0.750 | 2000 | n/a | 0.625 | 40.0 | 11.0 |",
        "| storpo_tree | 0 | 5 | 5250 | 7 | 0.625 [0.500, 0.750] | 0.312 | 0.750 | 2250 | 0.250 / 0.500 | 0.750 "
        "| 10.0 | 9.0 |",
        "| storpo_tree | 1 | 5 | 5250 | 7 | 0.250 [0.125, 0.375] | 0.125 | 0.750 | not reached | 0.000 / 0.000 "
        "| 1.000 | 12.0 | 8.0 |",
    ]
    assert "| arm - grpo | final pass@1 difference per seed (0, 1) | mean difference |" in text
    assert "target pass@1: 0.375 (--target); tokens to it: linear interpolation" in text
    assert "does not test branching" not in text  # a quarter of the prompts branched, on average
    assert (tmp_path / "variants.png").stat().st_size > 0


def test_variants_say_when_storpo_hardly_branched(tmp_path, capsys):
    """1/8 of seed 0's prompts branched in its second round (1/16 over its rounds), none of seed 1's: 1/32 on
    average, under 10%."""
    variants_runs(tmp_path, storpo_fallback=([1.0, 0.875], [1.0, 1.0]))
    assert variants.main([*ARMS_ARGV, "--out", str(tmp_path)]) == 0
    assert "storpo_tree branched from 3.1% of its prompts (mean over runs and rounds)" in capsys.readouterr().out
    assert "its comparison does not test branching" in (tmp_path / "variants.md").read_text()


def test_the_storpo_arm_is_the_variant_at_its_defaults():
    shared = variants.pinned(budget=1000, eval_every=5)
    arm = compose(variants.arm_overrides("learn_cpu", "storpo", shared, []))
    default = compose(["experiment=learn_cpu", "variant=storpo"])
    assert OmegaConf.to_container(arm.variant) == OmegaConf.to_container(default.variant)
    assert (value(arm, "variant.trees"), value(arm, "variant.max_steps")) == (2, 2)  # by hand: 2 trees, 2 points
    assert value(compose(variants.arm_overrides("learn_cpu", "storpo_tree", shared, [])), "variant.max_steps") == 4
    assert variants.DEFAULT_ARMS == ["grpo", "storpo"]


@pytest.mark.parametrize("experiment", RECIPES)
def test_the_step_budget_differs_from_the_token_budget_in_the_budget_keys_only(experiment):
    tokens = variants.pinned(budget=12_345, eval_every=3)
    arms = ("grpo", "storpo", "storpo_tree")
    by_tokens = {a: compose(variants.arm_overrides(experiment, a, tokens, [])) for a in arms}
    assert variants.rounds_for_steps(by_tokens, 12) == (12, 1)  # one optimizer step a round (the pins)
    steps = variants.pinned_rounds(12, eval_every=3)
    by_steps = {a: compose(variants.arm_overrides(experiment, a, steps, [])) for a in arms}
    for arm in arms:
        a, b = (leaves(OmegaConf.to_container(c[arm])) for c in (by_tokens, by_steps))  # unresolved
        differing = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert differing == {"trainer.max_epochs", "max_tokens_generated"}, arm
        assert (value(by_tokens[arm], "trainer.max_epochs"), value(by_steps[arm], "trainer.max_epochs")) == (1000, 12)
        assert value(by_tokens[arm], "callbacks.rollout_loop.max_tokens_generated") == 12_345
        assert value(by_steps[arm], "callbacks.rollout_loop.max_tokens_generated") is None  # what the loop reads


def test_the_rounds_of_a_step_budget_follow_the_steps_a_round_takes():
    """Four optimizer steps a round (16 micro-batches, 4 a step): 12 steps are 3 rounds, 10 no whole number."""
    shared = variants.pinned(budget=1000, eval_every=5)
    extra = ["trainer.accumulate_grad_batches=4"]
    configs = {a: compose(variants.arm_overrides("learn_cpu", a, shared, extra)) for a in ("grpo", "storpo")}
    assert variants.rounds_for_steps(configs, 12) == (3, 4)
    with pytest.raises(ValueError, match="--steps 10: not a positive multiple of the 4 optimizer steps a round"):
        variants.rounds_for_steps(configs, 10)
    with pytest.raises(SystemExit):  # --budget and --steps: one budget or the other
        variants.main(["--budget", "1000", "--steps", "4"])


def step_runs(out: Path) -> None:
    """Four rounds of one optimizer step each, evaluated at the start (step 0) and after the last (step 4); grpo's
    rounds cost 1000 tokens, storpo's 2000.

    grpo   seed 0: 0.125 -> 0.375 over 4000 tokens; seed 1: 0.125 -> 0.25
    storpo seed 0: 0.125 -> 0.625 over 8000 tokens; seed 1: 0.125 -> 0.5625
    """

    def e(acc):
        return ev(acc, acc - 0.125, acc + 0.125, acc / 2, 0.75)

    for arm, per_round, finals in (("grpo", 1000.0, (0.375, 0.25)), ("storpo", 2000.0, (0.625, 0.5625))):
        for seed, final in enumerate(finals):
            rounds = {i: per_round * (i + 1) for i in range(4)}
            write_run(out / f"{arm}_seed{seed}", rounds, {0: e(0.125), 4: e(final)}, fallback=[0.5] * 4)


def test_variants_per_step_and_per_token_by_hand(tmp_path):
    step_runs(tmp_path)
    argv = ["--experiment", "learn_cpu", "--seeds", "0", "1", "--steps", "4", "--target", "0.25"]
    assert variants.main([*argv, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "variants.md").read_text()
    assert "budget: 4 optimizer steps a run (4 rounds of 1, trainer.max_epochs)" in text
    assert "| `trainer.max_epochs` | `4` | `4` |" in text  # the settings, as composed
    assert "| `max_tokens_generated` | `null` | `null` |" in text
    assert "| `variant.max_steps` | `null` | `2` |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| grpo", "| storpo"))]
    assert [r for r in rows if "10,000 generated tokens" in r or "optimizer step |" in r] == [
        # gained per 10,000 tokens: grpo 0.25 / 0.4 = 0.625 and 0.125 / 0.4 = 0.3125, storpo 0.5 / 0.8 = 0.625 and
        # 0.4375 / 0.8 = 0.546875: 0 and 0.234375, mean 0.1171875 -+ 12.706 x 0.1171875
        "| storpo | 10,000 generated tokens | +0.0000, +0.2344 | +0.1172 | [-1.3718, +1.6062] | 1 / 1 / 0 |",
        # per step: grpo 0.25 / 4 and 0.125 / 4, storpo 0.5 / 4 and 0.4375 / 4: 0.0625 and 0.078125, mean
        # 0.0703125 -+ 12.706 x 0.0078125
        "| storpo | optimizer step | +0.0625, +0.0781 | +0.0703 | [-0.0290, +0.1696] | 2 / 0 / 0 |",
    ]
    for arm, seed, tokens in (("grpo", 0, 4000), ("grpo", 1, 4000), ("storpo", 0, 8000), ("storpo", 1, 8000)):
        assert any(r.startswith(f"| {arm} | {seed} | 2 | {tokens} | 4 | ") for r in rows), (arm, seed)  # both budgets
    assert (tmp_path / "variants.png").stat().st_size > 0


def test_a_finished_run_of_another_budget_is_not_read_back(tmp_path, capsys):
    step_runs(tmp_path)
    job = [*variants.arm_overrides("learn_cpu", "grpo", variants.pinned_rounds(4, 5), []), "seed=0"]
    (tmp_path / "grpo_seed0" / ".hydra").mkdir()
    record = tmp_path / "grpo_seed0" / ".hydra" / "overrides.yaml"
    record.write_text(json.dumps([*job, "trainer.enable_progress_bar=false"]))  # as the run records them
    argv = ["--experiment", "learn_cpu", "--seeds", "0", "1", "--out", str(tmp_path)]
    assert variants.main([*argv, "--steps", "4"]) == 0  # its own budget: read back
    assert "grpo_seed0: finished before, reading it" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="grpo_seed0 in .* finished with other overrides than this comparison"):
        variants.main([*argv, "--steps", "8"])
    with pytest.raises(SystemExit, match="grpo_seed0 in .* finished with other overrides"):
        variants.main(argv)  # the token budget


def test_default_target_is_halfway_to_the_lower_mean_final(tmp_path):
    variants_runs(tmp_path)
    arms = ("grpo", "storpo_tree")
    points = {a: [eval_points(read_run(tmp_path / f"{a}_seed{s}")) for s in (0, 1)] for a in arms}
    # start 0.125 everywhere; mean finals grpo 0.5, storpo (0.625 + 0.25) / 2 = 0.4375
    assert variants.default_target(points) == 0.125 + (0.4375 - 0.125) / 2


# ---- running the jobs -----------------------------------------------------------------------------------------------
def _fake_run(job, run_dir):
    """A job that records when it ran and the threads it was given, then finishes as a run does (or fails)."""
    code = (
        "import json, os, sys, time; d = sys.argv[1]; os.makedirs(d); start = time.time(); time.sleep(0.6); "
        "json.dump({'start': start, 'end': time.time(), 'threads': os.environ.get('OMP_NUM_THREADS')}, "
        "open(os.path.join(d, 'final_metrics.json'), 'w')); sys.exit(3 if 'fail' in d else 0)"
    )
    return [sys.executable, "-c", code, str(run_dir)]


def _spans(out, names):
    return {n: json.loads((out / n / "final_metrics.json").read_text()) for n in names}


@pytest.mark.slow  # starts processes: not the fast tier (tests/README.md)
def test_parallel_jobs_run_a_slot_each_one_thread_each_and_finished_ones_are_read(tmp_path, capsys):
    names = [f"trained_seed{s}" for s in range(5)]
    (tmp_path / "trained_seed4").mkdir()
    (tmp_path / "trained_seed4" / "final_metrics.json").write_text('{"start": 0, "end": 0, "threads": "before"}')
    dirs = run_jobs(tmp_path, [Job(n, ()) for n in names], parallel=True, slots=2, command=_fake_run)
    assert dirs == {n: tmp_path / n for n in names}
    spans = _spans(tmp_path, names[:4])
    # brute force: at no moment do more than 2 runs overlap, and the queue kept both slots busy (4 runs of
    # 0.6 s in 2 slots take two turns, not four)
    events = sorted([(s["start"], 1) for s in spans.values()] + [(s["end"], -1) for s in spans.values()])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == 2
    assert max(s["end"] for s in spans.values()) - min(s["start"] for s in spans.values()) < 4 * 0.6
    assert {s["threads"] for s in spans.values()} == {"1"}
    assert all((tmp_path / n / "wall_s.txt").is_file() for n in names[:4])
    assert _spans(tmp_path, names[4:])[names[4]]["threads"] == "before"  # read back, not rerun
    assert "trained_seed4: finished before, reading it" in capsys.readouterr().out


@pytest.mark.slow  # starts processes: not the fast tier (tests/README.md)
def test_sequential_jobs_run_one_at_a_time_with_every_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a user's default (a worker of `pytest -n` sets 1)
    names = ["grpo_seed0", "storpo_seed0"]
    run_jobs(tmp_path, [Job(n, ()) for n in names], parallel=False, command=_fake_run)
    a, b = _spans(tmp_path, names).values()
    assert a["end"] <= b["start"]
    assert {a["threads"], b["threads"]} == {os.environ.get("OMP_NUM_THREADS")}


@pytest.mark.slow  # starts processes: not the fast tier (tests/README.md)
def test_a_failed_job_exits_naming_its_log_and_stops_the_others(tmp_path):
    with pytest.raises(SystemExit, match=r"fail_seed0 failed \(exit 3\); see .*fail_seed0\.log"):
        run_jobs(tmp_path, [Job("fail_seed0", ()), Job("slow_seed0", ())], parallel=True, slots=2,
                 command=lambda job, d: _fake_run(job, d) if "fail" in job.name else [sys.executable, "-c",
                 "import time; time.sleep(60)"])  # fmt: skip
    assert not (tmp_path / "slow_seed0" / "wall_s.txt").exists()


# ---- benchmarks/storpo_branching.py -------------------------------------------------------------------------------
@pytest.mark.slow
def test_storpo_branching_counts_each_rule_and_both_is_their_union(capsys):
    """On the tiny model: a line per rule, shares in steps of 1/8 (8 prompts), and `both` branching wherever
    either rule does (a union of boundaries has at least as many as each part)."""
    from benchmarks import storpo_branching

    argv = ["--prompts", "8", "--show", "8", "model=tiny", "generator.max_new_tokens=24", "eval.enabled=false"]
    assert storpo_branching.main(argv) == 0
    out = capsys.readouterr().out
    shares = {}
    for rule in ("sentence", "line", "both"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"step_rule={rule}"))
        shares[rule] = float(line.split("boundaries) ")[1].split(",")[0])
        assert (shares[rule] * 8).is_integer()
    assert shares["both"] >= max(shares["sentence"], shares["line"])
    shown = [x for x in out.splitlines() if x.startswith("--- boundaries")]
    assert len(shown) == 8
    for x in shown:  # each completion: its count under `both` is at least each rule's
        counts = json.loads(x.split("boundaries ")[1].split("}")[0].replace("'", '"') + "}")
        assert counts["both"] >= max(counts["sentence"], counts["line"])
    token_rules = next(x for x in out.splitlines() if x.strip().startswith("step_rule=uncertainty | fixed"))
    lengths = [int(x.split(" tokens: ")[0].rsplit(", ", 1)[1]) for x in shown]
    assert float(token_rules.split("tokens) ")[1]) == sum(n >= 2 for n in lengths) / 8  # every completion of 2+


def test_an_arm_that_starts_elsewhere_is_compared_with_its_own_start(tmp_path):
    """The lr=0 run is the recipe's: it controls the runs that start where it does (`trained`, `entropy`), and a
    shuffled-list run, whose prompts differ, starts elsewhere and is compared with its own start: its win rate
    0.25 -> 0.375 is +0.125 over its start (0.25), not +0.25 over the lr=0 run's 0.125."""
    start = game_eval(0.125, 0.0625, 0.25, 0.5, 0.375, 0.625)
    other_start = game_eval(0.25, 0.125, 0.375, 0.5, 0.375, 0.625)
    end = game_eval(0.375, 0.3125, 0.4375, 0.25, 0.125, 0.375)
    selfplay_run(tmp_path / "control_seed0", {0: start, 2: start}, 300)
    selfplay_run(tmp_path / "trained_seed0", {0: start, 2: end}, 300)
    selfplay_run(tmp_path / "entropy_seed0", {0: start, 2: end}, 300)
    selfplay_run(tmp_path / "shuffled_seed0", {0: other_start, 2: end}, 300)
    args = ["--arms", "trained", "shuffled", "entropy", "--seeds", "0", "--out", str(tmp_path)]
    assert selfplay.main(args) == 0
    text = (tmp_path / "selfplay.md").read_text()
    rows = text.splitlines()
    assert "| 0 | trained | lr=0 | +0.250 | yes | n/a | n/a | -0.250 | yes | no | n/a |" in rows  # 0.3125 > 0.125
    assert "| 0 | entropy | lr=0 | +0.250 | yes | n/a | n/a | -0.250 | yes | no | n/a |" in rows
    assert "| 0 | shuffled | start | +0.125 | yes | n/a | n/a | -0.250 | yes | no | n/a |" in rows  # 0.3125 > 0.25
    controls = [row.split(" | ")[1] for row in rows if row.startswith("| 0 | control")]
    assert controls == ["control (lr=0)", "control (start)"]
    assert "seed 0: every evaluation of the lr=0 run equals the trained runs' start-of-run evaluation" in text
    assert "seed 0: shuffled started elsewhere than the lr=0 run (other prompts) and is compared with its own start" \
        in text  # fmt: skip
