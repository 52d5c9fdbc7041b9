"""The docs against the code: generated config tables, runnable examples, and every config key they name.

- docs/configuration.md's key tables are generated from the config files (grpo_lightning/config_docs/reference.py);
  the page must match what the config renders to, and every key shown must have a meaning (a yaml comment).
- docs/extending.md's code is written out as the package `my_pkg` and run; its commands are composed and dry-run
  as the CLI would (validation, data, reward, variant, plan; no model is loaded).
- Every config key and `group=option` written in docs/*.md and README.md exists in the default config or under
  one of the options listed in NON_DEFAULT; README's table of common overrides gives the composed defaults.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from grpo_lightning.config_docs import reference as config_reference
from grpo_lightning.config_docs import yaml_comments
from grpo_lightning.moved_keys import MOVED_KEYS, check_moved_overrides
from tests.conftest import CONF_DIR, ROOT, make_cfg

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PAGE = ROOT / "docs" / "configuration.md"
EXTENDING = ROOT / "docs" / "extending.md"
TRACKING = ROOT / "docs" / "tracking.md"


# ---- markdown --------------------------------------------------------------------------------------------------------
@dataclass
class Block:
    lang: str
    line: int
    text: str


@dataclass
class Markdown:
    blocks: list[Block]
    """Fenced code blocks."""
    commands: list[tuple[int, str]]
    """`python -m grpo_lightning ...` lines (bash blocks, indented blocks, inline code), continuations joined."""
    code: list[tuple[int, str, str, str]]
    """(line, code, the whole line, heading) of every piece of code that may name config keys: inline code spans
    and the lines of every code block that is not Python (Python attribute paths are not config keys)."""


def read_markdown(path: Path) -> Markdown:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, commands, code = [], [], []
    heading = ""
    fence: Block | None = None
    previous_blank = True
    indented = False
    for number, line in enumerate(lines, 1):
        if fence is not None:
            if line.strip().startswith("```"):
                blocks.append(fence)
                fence = None
            else:
                fence.text += line + "\n"
                if fence.lang != "python":
                    code.append((number, line, line, heading))
            continue
        if line.strip().startswith("```"):
            fence = Block(line.strip()[3:].strip(), number + 1, "")
            continue
        indented = line.startswith("    ") and (previous_blank or indented)
        previous_blank = not line.strip()
        if line.startswith("#"):
            heading = line
        if indented:
            code.append((number, line, line, heading))
        else:
            code += [(number, span, line, heading) for span in re.findall(r"`([^`]+)`", line)]
    for block in blocks:
        if block.lang in ("bash", "sh", "shell", ""):
            commands += joined_commands(block.line, block.text.splitlines())
    fenced = {n for b in blocks for n in range(b.line, b.line + len(b.text.splitlines()))}
    for n, text, context, _ in code:
        if n in fenced or not CLI.search(text):
            continue
        if text == context:  # a line of an indented block
            commands.append((n, text.strip()))
        elif text.startswith("python -m grpo_lightning"):  # inline code
            commands.append((n, text))
    return Markdown(blocks, commands, code)


def joined_commands(first_line: int, lines: list[str]) -> list[tuple[int, str]]:
    out, pending, start = [], "", first_line
    for offset, line in enumerate(lines):
        if not pending:
            start = first_line + offset
        text = line.rstrip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text = pending + text
        pending = ""
        if CLI.search(text):
            out.append((start, text.strip()))
    return out


CLI = re.compile(r"python -m grpo_lightning(\s|$)")


def command_args(command: str) -> list[str]:
    """The overrides of a `python -m grpo_lightning ...` line (its trailing `# ...` comment dropped)."""
    words = shlex.split(command, comments=True)
    return words[words.index("grpo_lightning") + 1 :]


# ---- compositions ----------------------------------------------------------------------------------------------------
# Options whose keys the docs may name although the default config does not have them: each composes a config that
# has them. A key found in none of these compositions (nor in the default) fails the test.
NON_DEFAULT = {
    "generator=vllm": "the vLLM engine's keys: device, memory, sleep mode, weight sync (docs/vllm.md, docs/gpu.md)",
    "generator=vllm_server": "the vLLM server generator's keys: servers, weight transfer (docs/scaling.md)",
    "variant=storpo": "STORPO's branching keys (docs/algorithm.md)",
    "loss=sapo": "SAPO's gate temperatures (docs/algorithm.md)",
    "loss=vespo": "VESPO's sequence-weight shape (docs/algorithm.md)",
    "model=qwen0.5b": "a Hub model's repo_id and revision",
    "model=local": "model.source.path",
    "model=tiny": "the random test model's shape and its tokenizer source",
    "model=random_qwen0.5b": "a published architecture with random weights (docs/gpu.md)",
    "trainer=ddp": "trainer.num_nodes and trainer.strategy (docs/multiprocess.md)",
    "trainer=fsdp": "the sharded strategy's keys (docs/scaling.md)",
    "reward=gsm8k_shaped": "the shaped reward's terms (docs/rewards.md)",
    "data=reasoning_gym": "the reasoning-gym source's keys (docs/data.md)",
    "reward=reasoning_gym_shaped": "the shaped reasoning-gym reward's terms (docs/data.md)",
    "experiment=learn_arith": "a reasoning-gym task's own keys as the recipe sets them (docs/data.md)",
    "experiment=selfplay_tictactoe": "self-play's keys: the variant, the game source, its rewards, the evaluator that "
    "plays (docs/selfplay.md)",
    "reward=selfplay_role": "the role baseline's transforms (docs/selfplay.md)",
    "reward=selfplay_rae": "the role baseline's transforms (docs/selfplay.md)",
    "probe=[gns,entropy]": "a probe's keys exist only when it is selected (docs/probes.md)",
    "logger=[tensorboard,csv,mlflow,wandb]": "a tracker's keys exist only when it is selected (docs/tracking.md)",
}
# Mappings whose entries are the user's to name (`reward.terms.<name>`, `+callbacks.mine._target_=...`).
OPEN_MAPPINGS = {
    "reward.terms",
    "reward.transforms",
    "reward.step_transforms",
    "reward.group_transforms",
    "callbacks",
    "generator.engine_kwargs",  # anything vllm.LLM takes
    "data.dataset.task_config",  # a reasoning-gym task's own keys
    "eval.checker",  # null, or the user's answer checker with its own keys
}
# Dotted names in the docs that are not config keys of this project.
NOT_CONFIG_KEYS = {
    "trainer.datamodule.round": "the Lightning trainer's attribute a callback reads (docs/extending.md)",
    "hydra.launcher.n_jobs": "an option of the hydra-joblib-launcher plugin, present when hydra/launcher=joblib",
}
# `group=option` where the option is a file of the reader's own config directory (hydra.searchpath examples).
USER_OPTIONS = {
    "variant=pairs": "docs/extending.md's my_pkg/conf/variant/pairs.yaml",
    "data=sums": "docs/extending.md's my_pkg/conf/data/sums.yaml",
    "experiment=mine": "docs/configuration.md's sweep from a package of your own",
}
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|json|ckpt|safetensors|gguf|png|csv|txt|log|bin|so|ipynb|toml)$")


@pytest.fixture(scope="module")
def compositions() -> dict[str, dict]:
    """The default config and each NON_DEFAULT option's, with Hydra's own node, interpolations unresolved."""
    out = {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for name in ["default", *NON_DEFAULT]:
            overrides = [] if name == "default" else [name]
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            out[name] = OmegaConf.to_container(cfg, resolve=False)
    return out


def lookup(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def has(tree: dict, key: str) -> bool:
    try:
        lookup(tree, key)
    except KeyError:
        return False
    return True


def group_options() -> dict[str, set[str]]:
    return {p.name: {f.stem for f in p.glob("*.yaml")} for p in Path(CONF_DIR).iterdir() if p.is_dir()}


# A config key (`loss.beta`, `+reward.terms.x._target_`) alone or with `=value`, not part of a path or a word.
KEY = re.compile(
    r"(?<![\w./$\-{])(?P<prefix>[+~]{0,2})(?P<key>[a-z_][\w-]*(?:\.(?:[\w*-]+|<[^>\s]+>|\.\.))*)(?P<rest>=\S*|\()?"
)


@dataclass
class Mention:
    path: Path
    line: int
    text: str
    heading: str
    prefix: str
    key: str
    value: str | None

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.text.strip()[:100]}"


def mentions(roots: set[str]) -> list[Mention]:
    """Every config key and `group=option` written in the docs (see KEY), with where it is."""
    found = []
    for path in DOCS:
        for line, text, context, heading in read_markdown(path).code:
            for m in KEY.finditer(text):
                key, rest = m["key"], m["rest"] or ""
                if key.split(".")[0] not in roots or rest.startswith("(") or FILE_SUFFIX.search(key):
                    continue
                if "." not in key and not rest.startswith("="):
                    continue  # a bare word (`seed`, `loss`) is prose, not necessarily the key
                value = rest[1:].rstrip("`'\",;)") if rest.startswith("=") else None
                found.append(Mention(path, line, context, heading, m["prefix"], key, value))
    return found


def problem(mention: Mention, compositions: dict[str, dict], options: dict[str, set[str]]) -> str | None:
    """Why a mention names nothing in the config, or None."""
    key = mention.key
    if key in NOT_CONFIG_KEYS:
        return None
    if key in MOVED_KEYS or f"{mention.prefix}{key}".lstrip("~+") in MOVED_KEYS:
        context = f"{mention.heading} {mention.text}".lower()
        if "migrat" in context or "old" in context or "moved" in context:
            return None  # documented as the old key it is
        return f"{key} has moved (MOVED_KEYS: {MOVED_KEYS[key]})"
    if "." not in key and key in options:  # group=option, option lists and sweeps
        if mention.value is None or mention.value == "null" or re.search(r"<|\.\.\.|\*", mention.value):
            return None  # no option, or a placeholder (`experiment=...`, `variant=<name>`)
        chosen = [v for v in re.split(r"[\[\],]", mention.value) if v]
        unknown = [v for v in chosen if v not in options[key] and f"{key}={v}" not in USER_OPTIONS]
        return f"{key}: no option {', '.join(unknown)} in conf/{key}/" if unknown else None
    parts = key.split(".")
    cut = next((i for i, p in enumerate(parts) if p.startswith("<") or "*" in p or p == ".."), len(parts))
    key = ".".join(parts[:cut])
    for tree in compositions.values():
        if has(tree, key):
            return None
        longest = max(
            (".".join(parts[:i]) for i in range(1, cut) if has(tree, ".".join(parts[:i]))), key=len, default=""
        )
        if longest in OPEN_MAPPINGS:
            return None
        if mention.prefix == "+" and longest and isinstance(lookup(tree, longest), dict):
            return None  # +key adds a key under an existing node
    return f"{key} is in no composition (default, {', '.join(NON_DEFAULT)})"


def test_every_config_key_the_docs_name_exists(compositions):
    options = group_options()
    roots = set(compositions["default"]) | set(options)
    found = mentions(roots)
    assert len(found) > 200, "the scan found too few keys: the pattern is broken"
    problems = [f"{m.where()}\n    {p}" for m in found if (p := problem(m, compositions, options)) is not None]
    assert not problems, "config keys in the docs that the config does not have:\n" + "\n".join(problems)


def test_the_key_scan_finds_what_it_should(compositions):
    """The scan is real: a wrong key, a moved key out of context, or an unknown option are reported."""
    options = group_options()
    cases = {
        "loss.bta": "is in no composition",
        "reward.format_bonus": "has moved",
        "model.source.repo_id": None,  # under model=qwen0.5b
        "+reward.terms.brevity._target_": None,
        "reward.terms.<name>": None,
    }
    for key, expected in cases.items():
        prefix = key[0] if key[0] in "+~" else ""
        got = problem(Mention(EXTENDING, 1, key, "", prefix, key.lstrip("+~"), None), compositions, options)
        assert (got is None) if expected is None else (expected in got), (key, got)
    bad_option = Mention(EXTENDING, 1, "", "", "", "loss", "grpo,nope")
    assert "no option nope" in problem(bad_option, compositions, options)


def test_readme_common_overrides_give_the_composed_defaults(tmp_path):
    """README's table of common overrides: each default is the composed one (`5e-4` = 0.0005)."""
    cfg = make_cfg(tmp_path)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| override | default |") :].split("\n\n")[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) > 8
    groups = group_options()
    for row in rows:
        keys_cell, default_cell = (c.strip() for c in row.strip("|").split("|")[:2])
        keys = re.findall(r"`([^`]+)`", keys_cell)
        defaults = [d.strip().strip("`") for d in default_cell.split(" / ")]
        assert len(keys) == len(defaults), row
        for key, documented in zip(keys, defaults, strict=True):
            if key in groups:  # a group: its default option
                assert documented == default_option(key), row
                continue
            actual = OmegaConf.select(cfg, key)
            if isinstance(actual, bool):
                assert documented == str(actual).lower(), row
            elif isinstance(actual, int | float):
                assert math.isclose(float(documented), float(actual)), row
            else:
                assert documented == str(actual), row


def default_option(group: str) -> str | None:
    entries = OmegaConf.load(Path(CONF_DIR) / "config.yaml").defaults
    return next(e[group] for e in entries if not isinstance(e, str) and group in e)


# ---- docs/configuration.md -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """The page's generated regions, rendered from the config files (each rendering composes ~25 configs)."""
    rendered = config_reference.Reference(link_dir=PAGE.parent)
    rendered.regions_text = rendered.regions()
    return rendered


def test_configuration_page_matches_the_config(reference):
    page = PAGE.read_text(encoding="utf-8")
    stale = [name for name, text in reference.regions_text.items() if config_reference.marker(name) not in page
             or f"{config_reference.marker(name)}\n{text}\n{config_reference.END}" not in page]  # fmt: skip
    assert not stale and config_reference.update_page(page, reference.regions_text) == page, (
        f"docs/configuration.md differs from the config in: {', '.join(stale) or 'the page'}. Run "
        "`python -m grpo_lightning.config_docs.reference --write` and commit the page."
    )


def test_every_key_in_the_tables_has_a_meaning(reference):
    assert not reference.missing, (
        f"keys without a comment in their yaml file (the comment is their documentation): {reference.missing}"
    )


@pytest.mark.slow  # renders every group's table twice (~8 s): make test, not make check
def test_changing_a_default_changes_the_rendered_table(tmp_path, reference):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    grpo = conf / "loss" / "grpo.yaml"
    text = grpo.read_text()
    assert "\nbeta: 0.0 " in text
    grpo.write_text(text.replace("\nbeta: 0.0 ", "\nbeta: 0.5 ").replace("k3 KL weight", "weight of the k3 KL"))
    (conf / "loss" / "zz_mine.yaml").write_text("# My loss.\n_target_: x.Y   # a class\nloss_type: grpo   # the type\n")
    after = config_reference.Reference(conf, link_dir=PAGE.parent).regions()
    assert {name for name, text in reference.regions_text.items() if after[name] != text} == {"groups", "loss"}
    beta = next(line for line in after["loss"].splitlines() if line.startswith("| `loss.beta` |"))
    assert beta.startswith("| `loss.beta` | `0.5` | `0.04` |") and "weight of the k3 KL" in beta, beta
    header = next(line for line in after["loss"].splitlines() if line.startswith("| key |"))
    assert "- `loss=zz_mine`: My loss." in after["loss"] and header.endswith("| `zz_mine` | meaning |"), header
    assert "`zz_mine`" in next(line for line in after["groups"].splitlines() if line.startswith("| `loss` |"))
    # the command line's check reports it
    assert config_reference.main(["--check", "--conf-dir", str(conf), "--page", str(PAGE)]) == 1


def test_the_yaml_comment_rules(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "# The file: what this option is.\n"
        "#   python -m grpo_lightning x=y   # an example, not prose\n"
        "a: 1   # inline\n"
        "# above b,\n"
        "# two lines\n"
        "b: '# not a comment'   # and inline\n"
        "node:   # the node\n"
        "  _target_: x.Y\n"
        "  c: 2                # a long comment\n"
        "                      # continued\n"
        "# a heading for what follows\n"
        "\n"
        "d: 3\n"
    )
    comments = yaml_comments.read_comments(path)
    assert comments.header == "The file: what this option is."
    assert comments.keys == {
        "a": "inline",
        "b": "above b, two lines and inline",
        "node": "the node",
        "node.c": "a long comment continued",
    }


def test_the_page_needs_every_region_once():
    regions = {"a": "table a", "b": "table b"}
    page = f"x\n{config_reference.marker('a')}\nold\n{config_reference.END}\ny\n{config_reference.marker('b')}\n"
    with pytest.raises(ValueError, match="has no <!-- end generated -->"):
        config_reference.update_page(page, regions)
    page += f"{config_reference.END}\n"
    assert config_reference.update_page(page, regions).splitlines()[2] == "table a"
    with pytest.raises(ValueError, match="no region for b"):
        config_reference.update_page(page.split("y\n")[0], regions)
    with pytest.raises(ValueError, match="no such region"):
        config_reference.update_page(page, {"a": ""})


# ---- docs/extending.md -----------------------------------------------------------------------------------------------
PLACEHOLDERS = {"/path/to/save_pretrained/folder": "{folder}", "<hub id>": "my-org/my-model"}


def write_package(page: Markdown, root: Path) -> list[Path]:
    """The page's blocks whose first line is `# my_pkg/<file>`, written under `root` (packages get __init__.py)."""
    written = []
    for block in page.blocks:
        first = block.text.splitlines()[0] if block.text.strip() else ""
        match = re.fullmatch(r"# (my_pkg/\S+)", first.strip())
        if block.lang == "python":
            assert match, f"docs/extending.md:{block.line}: a Python block must name its file (# my_pkg/...)"
        if match is None:
            continue
        path = root / match[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)
        written.append(path)
    for directory in {p.parent for p in written} | {root / "my_pkg"}:
        while directory != root:
            (directory / "__init__.py").touch()
            directory = directory.parent
    return written


class ScriptedGenerator:
    """Returns the scripted completions of each prefix and records each call (a stand-in for an engine)."""

    def __init__(self, script: dict[tuple[int, ...], list[list[int]]]):
        from grpo_lightning.generation.base import SamplingConfig

        self.sampling = SamplingConfig(max_new_tokens=8)
        self.script = script
        self.calls = []

    def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
        from grpo_lightning.types import Completion

        self.calls.append((prefixes, num_samples))
        return [
            [
                Completion(ids, [-0.25 * (j + 1)] * len(ids), finished=True)
                for j, ids in enumerate(self.script[tuple(p)])
            ]
            for p in prefixes
        ]


WORDS = {1: "#### ", 2: "3", 3: "4", 4: "7", 5: "no answer"}


def decode(ids):
    return "".join(WORDS[i] for i in ids)


def check_pairs(variants_module, tmp_path):
    """The page's variant on two prompts, with the default GSM8K reward: rollouts checked by hand."""
    from grpo_lightning.rewards.pipeline import build_reward
    from grpo_lightning.types import Prompt
    from grpo_lightning.variants import VARIANTS

    pairs_cls = variants_module.Pairs
    assert VARIANTS["pairs"] is pairs_cls
    prompts = [Prompt([10, 11], "3", "q0", 0), Prompt([20], "7", "q1", 1)]
    generator = ScriptedGenerator({(10, 11): [[1, 2], [1, 3]], (20,): [[5], [1, 4]]})
    reward = build_reward(make_cfg(tmp_path / "reward").reward, loss_type="grpo", max_new_tokens=8)
    variant = pairs_cls()
    assert 3 * variant.group().rollouts == 6
    rollouts = variant.generate_rollouts(generator, prompts, reward, decode)
    assert generator.calls == [([[10, 11], [20]], 2)]
    assert [r.text for r in rollouts] == ["#### 3", "#### 4", "no answer", "#### 7"]
    assert [r.group_id for r in rollouts] == [0, 0, 1, 1]
    assert [r.prompt_ids for r in rollouts] == [[10, 11], [10, 11], [20], [20]]
    assert [r.gen_logprobs for r in rollouts] == [[-0.25, -0.25], [-0.5, -0.5], [-0.25], [-0.5, -0.5]]
    assert [r.reward for r in rollouts] == [1.0, 0.1, 0.0, 1.0]  # correct, formatted but wrong (format_bonus), none
    assert [r.answer_extracted for r in rollouts] == [True, True, False, True]
    assert variant.metrics == {"rollout/pairs_answered_frac": 0.75}
    # GRPO advantages: (r - group mean) / (unbiased group std + 1e-4)
    spread0, spread1 = 0.45 / (math.sqrt(2 * 0.45**2) + 1e-4), 0.5 / (math.sqrt(2 * 0.5**2) + 1e-4)
    expected = [spread0, -spread0, -spread1, spread1]
    assert all(math.isclose(r.advantage, a, rel_tol=1e-5) for r, a in zip(rollouts, expected, strict=True))
    # sampled through dynamic sampling's path: no advantages until assign_advantages
    again = variant.sample_rollouts(generator, prompts, reward, decode)
    assert [r.advantage for r in again] == [0.0] * 4
    assert pairs_cls(num_generations=3).settings == pairs_cls(variants_module.PairsSettings(3)).settings
    assert pairs_cls(num_generations=3).group().rollouts == 3


def last_stone_value(strategies: dict, stones: int = 7, mover: int = 0) -> float:
    """Seat 0's expected result in the page's game (seven stones, take one or two, who takes the last wins), each
    seat playing its table {(stones, seat): {move: p}}: the rules written out again, not the class's."""
    if stones == 0:
        return 1.0 if 1 - mover == 0 else -1.0  # the previous mover took the last stone
    table = strategies[mover][stones, mover]
    return sum(p * last_stone_value(strategies, stones - int(m[1]), 1 - mover) for m, p in table.items() if p)


def last_stone_pure(seat: int):
    for picks in itertools.product(*(["[1]"] if n == 1 else ["[1]", "[2]"] for n in range(1, 8))):
        yield {(n, seat): {m: 1.0} for n, m in zip(range(1, 8), picks, strict=True)}


def check_game(games_module):
    """The page's game with an exact evaluator, against a brute force over every pure strategy of each seat (64):
    the exploitability of perfect play is 0 and of random strategies (seeded) the brute force's; playing the best
    response table wins the most any pure strategy wins."""
    game = games_module.LastStone()
    game.reset(0)
    keys = [p.information_set() for p in game.strategy_positions()]
    assert len(keys) == 14 and game.responds_exactly

    def options(n):
        return ["[1]"] if n == 1 else ["[1]", "[2]"]

    perfect = {(n, s): ({f"[{n % 3}]": 1.0} if n % 3 else {m: 1 / len(options(n)) for m in options(n)})
               for n, s in keys}  # fmt: skip
    assert game.exploitability(perfect) == pytest.approx(0.0, abs=1e-12)
    rng = random.Random(0)
    for _ in range(5):
        strategy = {}
        for n, s in keys:
            p = rng.choice([0.0, 0.25, 0.5, 1.0]) if n > 1 else 1.0
            strategy[n, s] = {"[1]": p, "[2]": 1 - p} if n > 1 else {"[1]": 1.0}
        best0 = max(last_stone_value({0: pure, 1: strategy}) for pure in last_stone_pure(0))
        best1 = max(-last_stone_value({0: strategy, 1: pure}) for pure in last_stone_pure(1))
        assert game.exploitability(strategy) == pytest.approx((best0 + best1) / 2, abs=1e-12)
        answer = game.best_response(strategy)
        assert last_stone_value({0: answer, 1: strategy}) == pytest.approx(best0, abs=1e-12)
        assert -last_stone_value({0: strategy, 1: answer}) == pytest.approx(best1, abs=1e-12)


def check_loss_type():
    """The page's loss type, by its import path, on a hand example: on-policy (ratio 1) its gradient is -A_i / (n_i B)
    on each trained token, and off-policy its value is -mean_i(mean_t r_it) A_i (no clip: a ratio of 3 counts)."""
    import torch

    from grpo_lightning.algorithm.losses import GRPOLoss

    loss_fn = GRPOLoss(loss_type="my_pkg.losses.Unclipped")
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    logp = old.clone().requires_grad_(True)
    loss_fn(logp, old, None, adv, mask).loss.backward()
    expected = torch.tensor([[-1 / 6] * 3, [1 / 2, 1 / 2, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    ratios = torch.tensor([[3.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    value = loss_fn(old + ratios.log(), old, None, adv, mask).loss.item()
    assert value == pytest.approx((-(3 + 1 + 1) / 3 * 1 + (1 + 0.5) / 2 * 2) / 2, rel=1e-6)


def check_callbacks(callbacks_module, capsys):
    from grpo_lightning.types import Rollout

    rollout = Rollout([1], [2], [-1.0], 1.0, 0, False)
    callback = callbacks_module.RoundSize(every=2)
    for index in (3, 4):
        round_ = SimpleNamespace(index=index, rollouts=(rollout, rollout), micro_batches=(), schedule=())
        callback.on_train_epoch_start(SimpleNamespace(datamodule=SimpleNamespace(round=round_)), None)
    assert capsys.readouterr().out == "round 4: 2 rollouts\n"


def check_sources(sources_module) -> None:
    """The page's data source: its problems are the sums of their questions' terms, the test split shares no
    question with training, its checker reads the reply's number, and the interface's defaults hold."""
    from grpo_lightning.data.source import DataSource

    sums = sources_module.Sums()
    assert isinstance(sums, DataSource)
    train, test = sums.load(), sums.test_split(path=None, num_problems=4).load()
    assert (len(train), len(test)) == (70, 30)
    assert not {p.question for p in train} & {p.question for p in test}
    for problem in train + test:
        a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\?", problem.question).groups())
        assert problem.answer == str(a + b) and problem.solution.endswith(f"#### {a + b}")
    assert sums.messages("What is 1 + 2?")[0]["content"].startswith("What is 1 + 2?\n")
    right, wrong = sums.checker().check("3 + 4 = 7\n#### 7", "7"), sums.checker().check("#### 8", "7")
    assert (right.correct, right.strict, wrong.correct, wrong.strict) == (True, True, False, False)
    assert (sums.gives_records, sums.has_solutions, sums.card_tags) == (False, True, ())
    assert sums.card_description() == sums.describe() == "one-digit sums (train)"
    with pytest.raises(ValueError, match=r"data.dataset.split must be one of train, test \(got 'dev'\)"):
        sources_module.Sums(split="dev")


def check_declared_keys(settings_module, tmp_path: Path) -> None:
    """The page's declaration: the config check names a bad key of a node whose `_target_` is the page's class,
    with the same message as the class's own constructor."""
    from grpo_lightning.app.validation import check_rules

    cfg = make_cfg(tmp_path / "declared", ["variant._target_=my_pkg.variants.Pairs", "variant.num_generations=1"])
    with pytest.raises(ValueError) as err:
        settings_module.Pairs(num_generations=1)
    assert check_rules(cfg) == [str(err.value)] == ["variant.num_generations must be >= 2 (got 1)"]


def dry_run_command(args: list[str], output_dir: Path):
    """A documented command as the CLI runs it with dry_run=true: the CLI's own check of moved keys, composition,
    validation, data, reward, variant, plan; no model is loaded. Also builds the extra callbacks. Returns the cfg."""
    from hydra.utils import instantiate

    from grpo_lightning.app.train import train

    moved = check_moved_overrides(args)
    assert moved is None, moved
    cfg = make_cfg(output_dir, args)
    with open_dict(cfg):
        cfg.dry_run = True
    metrics = train(cfg)
    assert metrics["dry_run/reference_reward_mean"] == 1.0
    defaults = make_cfg(output_dir, []).callbacks  # the run builds these with its objects (app/train.py)
    for name, node in cfg.callbacks.items():
        if name not in defaults:  # the page's own callbacks take only config arguments
            instantiate(node)
    return cfg


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    """docs/extending.md's `my_pkg`, importable; removed again (modules and registered variants) afterwards."""
    from grpo_lightning.variants import VARIANTS

    page = read_markdown(EXTENDING)
    root = tmp_path / "site"
    written = write_package(page, root)
    monkeypatch.syspath_prepend(str(root))
    VARIANTS.pop("pairs", None)
    yield page, written
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[name]
    VARIANTS.pop("pairs", None)


def test_extending_examples_run(my_pkg, tmp_path, monkeypatch, capsys):
    import importlib

    from hydra.utils import instantiate

    import grpo_lightning.models.sources as sources

    page, written = my_pkg
    assert {p.name for p in written} == {
        "variants.py", "callbacks.py", "losses.py", "pairs.yaml", "sources.py", "sums.yaml", "probes.py", "games.py"
    }  # fmt: skip
    check_declared_keys(importlib.import_module("my_pkg.variants"), tmp_path)
    check_sources(importlib.import_module("my_pkg.sources"))
    check_pairs(importlib.import_module("my_pkg.variants"), tmp_path)
    check_callbacks(importlib.import_module("my_pkg.callbacks"), capsys)
    check_loss_type()
    check_game(importlib.import_module("my_pkg.games"))

    folder = tmp_path / "saved"  # shaped like save_pretrained's output (LocalSource checks it), a tiny Llama
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}'
    )
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(sources, "endpoint_reachable", lambda url, timeout_s: False)  # a Hub id: no network here

    assert len(page.commands) >= 5, page.commands
    variants, sources = [], []
    for number, (line, command) in enumerate(page.commands):
        for placeholder, value in PLACEHOLDERS.items():
            command = command.replace(placeholder, value.format(folder=folder))
        try:
            cfg = dry_run_command(command_args(command), tmp_path / f"run{number}")
        except Exception as err:
            raise AssertionError(f"docs/extending.md:{line}: {command}\n{type(err).__name__}: {err}") from err
        if cfg.variant._target_.startswith("my_pkg."):
            variants.append(instantiate(cfg.variant))
        if cfg.data.dataset._target_.startswith("my_pkg."):
            sources.append(instantiate(cfg.data.dataset))
    capsys.readouterr()
    assert [type(s).__name__ for s in sources] == ["Sums", "Sums"], sources  # the command line's and data=sums
    # variant._target_=...: variant=grpo's num_generations (G) comes along; variant=pairs: its own file's 2
    assert sorted(v.settings.num_generations for v in variants) == [2, 8], variants


def test_the_extending_probe_reads_the_forward_and_changes_nothing(my_pkg, tiny_cfg):
    """The page's probe on a tiny run (2 rounds, 2 micro-batches an optimizer step): what it logs each step is the
    plain forward's -mean log p of the step's trained tokens, and the parameters after training are bitwise those
    of the same run without it."""
    import importlib

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_lightning.app.train import build_run
    from tests.probes.brute_force import StepBatches, plain_logprobs

    class PlainSurprise(StepBatches):
        """-mean log p of each step's trained tokens by a plain forward of the policy before the step (the model's
        own logits, float64 log-softmax; tests/probes/brute_force.py), under a forked RNG."""

        def __init__(self) -> None:
            super().__init__()
            self.values: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            total, tokens = 0.0, 0
            with torch.no_grad(), torch.random.fork_rng():
                for batch in self.batches:
                    logp = plain_logprobs(pl_module.policy, batch, pl_module.temperature)  # [B, C]
                    trained = batch.completion_mask.bool()
                    total -= float(logp[trained].sum())
                    tokens += int(trained.sum())
            self.values.append(total / tokens)

    surprise_cls = importlib.import_module("my_pkg.probes").Surprise
    shape = ("eval.enabled=false", "data.prompts_per_round=2", "data.groups_per_micro_batch=1")

    def trained(cfg, *extra):
        run = build_run(cfg)
        run.trainer.callbacks.extend(extra)
        run.fit()
        params = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
        return run, params

    _, base = trained(tiny_cfg(*shape))
    truth = PlainSurprise()
    cfg = tiny_cfg(*shape, "+probe.surprise._target_=my_pkg.probes.Surprise")
    run, probed = trained(cfg, truth)
    (probe,) = [cb for cb in run.trainer.callbacks if isinstance(cb, surprise_cls)]
    assert run.module.forward_observers == []  # it left at teardown
    assert len(truth.values) == 2 and len(truth.batches) == 2  # two steps of two micro-batches
    assert probe.values == pytest.approx(truth.values, rel=1e-5)  # float32 forwards by two code paths
    acc = EventAccumulator(f"{cfg.paths.output_dir}/tensorboard")
    acc.Reload()
    logged = [e.value for e in acc.Scalars("probe/surprise/token_mean")]
    assert logged == pytest.approx(probe.values, rel=1e-6)  # tensorboard keeps float32
    assert base.keys() == probed.keys()
    assert all(torch.equal(base[n], probed[n]) for n in base)


def test_the_command_check_rejects_what_the_cli_rejects(tmp_path):
    """What the page used to document fails the check: moved keys, and a source's keys on another source."""
    with pytest.raises(AssertionError, match="reward._target_ has moved"):
        dry_run_command(["reward._target_=my.Reward"], tmp_path / "a")
    with pytest.raises(AssertionError, match="reward.format_bonus has moved"):
        dry_run_command(["~reward.format_bonus"], tmp_path / "b")
    with pytest.raises(Exception, match="repo_id"):
        hub = ["model.source._target_=grpo_lightning.models.sources.HubSource", "model.source.repo_id=x/y"]
        dry_run_command(hub, tmp_path / "c")


# ---- docs/tracking.md ------------------------------------------------------------------------------------------------
def test_tracking_commands_select_the_loggers_they_name(tmp_path, capsys):
    """Each command of docs/tracking.md dry-runs as the CLI would (its tracker's package checked, its keys against
    their declarations) and selects the loggers it names, in its order. Its Python example runs on a real run in
    tests/test_tracking_runs.py."""
    commands = read_markdown(TRACKING).commands
    assert len(commands) >= 6, commands
    for number, (line, command) in enumerate(commands):
        args = command_args(command)
        try:
            cfg = dry_run_command(args, tmp_path / f"run{number}")
        except Exception as err:
            raise AssertionError(f"docs/tracking.md:{line}: {command}\n{type(err).__name__}: {err}") from err
        chosen = next((a.split("=", 1)[1] for a in args if a.startswith("logger=")), "tensorboard")
        assert list(cfg.get("logger") or {}) == [n for n in re.split(r"[\[\],]", chosen) if n], (line, command)
    capsys.readouterr()
