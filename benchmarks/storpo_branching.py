"""Whether STORPO can branch on a task: the untrained policy's first completions, their step boundaries and
their answers.

    python benchmarks/storpo_branching.py                                  # learn_arith's task and prompt
    python benchmarks/storpo_branching.py data.dataset.task_config.max_terms=4 \
        "data.dataset.system_prompt='Solve it step by step, one short sentence a step.'"

STORPO samples one completion per prompt and branches from points inside it (docs/algorithm.md); under a text
rule without a token fallback (`variant.fallback_rule=none`), a prompt whose completion has fewer than
`variant.min_steps` reasoning-step boundaries is sampled as a plain group of G. On a task
whose replies are one line STORPO trains on GRPO groups, and a comparison of the two variants says nothing about
branching. This builds the run as the CLI does (overrides after the options; default `experiment=learn_arith`),
samples one completion for each of `--prompts` training prompts with the run's engine and sampling settings (what
STORPO's first call samples), and prints the share whose answer is right (the evaluation's format-free reading),
the mean completion tokens, the share a token rule (`uncertainty`, `fixed`) branches from (every completion of
two or more tokens), and for each text rule (sentence, line, both): the share of completions it would branch from
(at least `--min-steps` boundaries), the mean boundaries and the share right among the branchable ones; then a few
completions. A small model often writes its steps as lines (`1. Multiply ...`),
which the sentence rule does not split (a period after a digit never splits).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="training prompts, one completion each")
    parser.add_argument("--min-steps", type=int, default=2, help="boundaries STORPO needs (variant.min_steps)")
    parser.add_argument("--show", type=int, default=3, help="completions to print")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("overrides", nargs="*", help="config overrides (default: experiment=learn_arith)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from grpo_lightning.algorithm.branch_points import TEXT_RULES, step_boundaries
    from grpo_lightning.app.train import build_run
    from tests.conftest import make_cfg

    overrides = args.overrides or ["experiment=learn_arith"]
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=learn_arith", *overrides]
    cfg = make_cfg(Path(tempfile.mkdtemp()), [*overrides, f"data.prompts_per_round={args.prompts}"])
    run = build_run(cfg)
    loop, datamodule = run.callbacks["rollout_loop"], run.datamodule
    engine = loop.generator
    datamodule.setup("fit")
    checker = datamodule.dataset.checker()
    prompts = datamodule.prompts_for_round(0, engine.tokenizer)
    groups = engine.generate([p.prompt_ids for p in prompts], 1)
    rows = []
    for prompt, (completion,) in zip(prompts, groups, strict=True):
        text = loop.decode(completion.token_ids)  # the text STORPO finds its boundaries in
        verdict = checker.check(text, prompt.answer, prompt.record)
        boundaries = {rule: len(step_boundaries(text, rule)) for rule in TEXT_RULES}
        rows.append((boundaries, verdict.correct, len(completion.token_ids), text))
    n = len(rows)
    print(f"overrides: {' '.join(overrides)}")
    print(f"system prompt: {cfg.data.dataset.get('system_prompt')!r}")
    print(
        f"{n} prompts, one completion each, T={cfg.generator.temperature}, {cfg.generator.max_new_tokens} new "
        f"tokens: right {sum(r[1] for r in rows) / n:.3f}, mean tokens {sum(r[2] for r in rows) / n:.1f}"
    )
    two = sum(r[2] >= 2 for r in rows) / n
    print(f"  step_rule=uncertainty | fixed: branchable (>= 2 tokens) {two:.3f}")
    for rule in TEXT_RULES:
        branchable = [r for r in rows if r[0][rule] >= args.min_steps]
        right = sum(r[1] for r in branchable) / len(branchable) if branchable else float("nan")
        print(
            f"  step_rule={rule:<8} branchable (>= {args.min_steps} boundaries) {len(branchable) / n:.3f}, "
            f"mean boundaries {sum(r[0][rule] for r in rows) / n:.2f}, right among branchable {right:.3f}"
        )
    for boundaries, correct, tokens, text in rows[: args.show]:
        print(f"--- boundaries {boundaries}, {'right' if correct else 'wrong'}, {tokens} tokens: {text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
