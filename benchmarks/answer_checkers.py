"""Where the GSM8K answer checkers agree: verl's strict `#### n`, ours (`GSM8KReward`) and math-verify.

First the 8,792 GSM8K reference answers (train 7,473 + test 1,319, the packaged JSONL): each solution's `#### n`
line is checked against its own reference answer, and ours and math-verify must accept every one (the script
exits 1 otherwise); then each whole solution, whose worked steps come before that line. Then, when given, model
completions: each checker's accuracy, and every completion where ours and math-verify disagree, counted by class
(docs/answer_checking.md) with examples.

    python benchmarks/answer_checkers.py                                  # the reference solutions only
    python benchmarks/answer_checkers.py --completions samples.jsonl      # rows {"completion": ..., "answer": "18"}
    python benchmarks/answer_checkers.py --tensorboard outputs/           # the eval/samples tables of runs below
    python benchmarks/answer_checkers.py --generate 300                   # greedy completions of the embedded model
                                                                          # (minutes on a CPU; only with this flag)

`--out report.md` also writes the report to a file. Needs the math-verify extra (`make install`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_lightning.data.gsm8k import GSM8K  # noqa: E402
from grpo_lightning.rewards.gsm8k import (  # noqa: E402
    extract_predicted_answer,
    find_predicted_answer,
    gsm8k_correct,
    strict_correct,
)
from grpo_lightning.rewards.math_verify import math_verify_answer  # noqa: E402

CLASSES = {
    "no_marker": "answer without ####: no `####`, `\\boxed{}` or 'the answer is', so ours finds nothing; "
    "math-verify reads 'Answer:', 'final answer is' or the last number",
    "after_answer": "text after the answer: numbers written after the marked answer; math-verify reads the last one",
    "answer_word": "an earlier 'answer': math-verify reads the number after a word 'answer' (its anchor, ranked "
    "above the last number) over a later `####` line",
    "boxed": "last number vs boxed: a `\\boxed{}` and a later `####`; math-verify prefers the box, ours the later line",
    "glued": "number glued to ####: `####18` or `#### \\$18`; ours reads it, math-verify finds no number there",
    "fractions": "fractions: `37/2` or `\\frac{37}{2}`; math-verify evaluates them, ours reads the numerator or "
    "nothing",
    "expressions": "expressions: `2 * 9`; math-verify evaluates them, ours reads the first number",
    "commas": "commas: `1 450 000`, a decimal comma `3,5`, `1{,}000`; math-verify joins the digits, ours stops",
    "units_percent": "units/percent: `USD 18`, `\\boxed{18 \\text{ dollars}}`, `25%` read as 0.25 by math-verify",
    "other": "other",
}
CHECKERS = ("strict", "ours", "math_verify", "math_verify_latex")
NAMES = {
    "strict": "strict `#### n` (verl)",
    "ours": "ours (GSM8KReward)",
    "math_verify": "math-verify (its defaults)",
    "math_verify_latex": "math-verify as TRL's accuracy_reward (LaTeX only)",
}

_MARKER = re.compile(r"####|\\boxed\{|the answer is", re.IGNORECASE)
_FRACTION = re.compile(r"\\d?frac|\d\s*/\s*\d")
_EXPRESSION = re.compile(r"\d\s*(?:[-+*×÷^]|\\times|\\cdot|\\div)\s*\(?\d")
_GROUPING = re.compile(r"\d(?: \d{3}(?!\d)|\{,\}\d|,\d{1,2}(?!\d)|,\d{4,})")
_UNIT = re.compile(r"%|percent|\\text|\\mathrm|[A-Za-z]{2,}")
_PERCENT_AFTER = re.compile(r"^-?[\d.,]+\s*(?:\\?%|percent)")


@dataclass(frozen=True)
class Verdicts:
    """What each checker says of one completion, and what ours and math-verify read as its answer."""

    strict: bool
    ours: bool
    math_verify: bool
    math_verify_latex: bool
    ours_answer: str | None
    math_verify_answer: str | None


def judge(completion: str, reference: str) -> Verdicts:
    ours = gsm8k_correct(completion, reference)
    ours_answer = extract_predicted_answer(completion)
    mv, mv_answer = math_verify_answer(completion, reference)
    latex, _ = math_verify_answer(completion, reference, extraction="latex")
    return Verdicts(strict_correct(completion, reference), ours, mv, latex, ours_answer, mv_answer)


def classify(completion: str, math_verify_read: str | None) -> str:
    """The class of a completion on which ours and math-verify disagree (CLASSES), from what each read."""
    match = find_predicted_answer(completion)
    if match is None:
        markers = list(_MARKER.finditer(completion))
        if not markers:
            return "no_marker"
        tail = completion[markers[-1].end() :].split("\n", 1)[0][:40]
        return _shape(tail) or "other"
    lead = completion[match.start() : match.start("num")]
    if math_verify_read is None or "\\$" in lead or re.fullmatch(r"####\S*", lead):
        return "glued"
    boxes = re.findall(r"\\boxed\{(.*?)\}", completion)
    if boxes and not match.group(0).startswith("\\boxed") and math_verify_read.strip() in (b.strip() for b in boxes):
        return "boxed"
    tail = completion[match.start("num") :].split("\n", 1)[0][:40]
    if _PERCENT_AFTER.match(tail):
        return "units_percent"
    shape = _shape(tail, units=False)
    if shape:
        return shape
    places = [m.start() for m in re.finditer(re.escape(math_verify_read.strip()), completion)]
    if any(re.search(r"answer", completion[max(i - 100, 0) : i], re.IGNORECASE) for i in places):
        return "answer_word"  # math-verify's `answer.{0,100}=` / `answer.{0,50}?` anchors
    return "after_answer" if places and places[-1] >= match.end() else "other"


def _shape(tail: str, units: bool = True) -> str | None:
    """The class an answer's own text points to: a fraction, an expression, digit grouping, a unit."""
    for name, pattern in (("fractions", _FRACTION), ("expressions", _EXPRESSION), ("commas", _GROUPING)):
        if pattern.search(tail):
            return name
    return "units_percent" if units and _UNIT.search(tail) else None


def readings_differ(completion: str, ours_answer: str | None) -> bool:
    """Whether math-verify reads another answer than ours, whatever the reference: math-verify's reading is
    checked against ours as the gold answer (symbolically, as it checks a reference); with nothing read by ours,
    they differ when math-verify reads anything."""
    if ours_answer is None:
        return math_verify_answer(completion, "0")[1] is not None
    return not math_verify_answer(completion, ours_answer)[0]


def reading_report(items: list[tuple[str, str]], verdicts: list[Verdicts], examples: int) -> list[str]:
    """Where ours and math-verify read different answers, right or wrong: on a model that is rarely right the
    correctness verdicts agree by default, while the readings still show how each checker reads its replies."""
    found: dict[str, list[tuple[str, str, Verdicts]]] = {}
    for (completion, answer), v in zip(items, verdicts, strict=True):
        if readings_differ(completion, v.ours_answer):
            found.setdefault(classify(completion, v.math_verify_answer), []).append((completion, answer, v))
    total = sum(len(x) for x in found.values())
    lines = [f"ours and math-verify read different answers in {total} of {len(items)}", "",
             "| class | count |", "|---|---|"]  # fmt: skip
    lines += [f"| {CLASSES[n]} | {len(found[n])} |" for n in sorted(found, key=lambda n: -len(found[n]))]
    for name, cases in found.items():
        lines += ["", f"### {name} (readings): {CLASSES[name]}"]
        for completion, answer, v in cases[:examples]:
            shown = completion if len(completion) <= 400 else "…" + completion[-400:]
            said = f"ours read {v.ours_answer!r}, math-verify read {v.math_verify_answer!r}"
            lines += ["", f"reference {answer}: {said}", "", "    " + shown.replace("\n", "\n    ")]
    return lines


# ---- inputs ---------------------------------------------------------------------------------------------------------
def reference_solutions() -> list[tuple[str, str, str]]:
    """(split, solution, answer) of every packaged GSM8K problem."""
    return [(s, p.solution, p.answer) for s in ("train", "test") for p in GSM8K(source="packaged", split=s).load()]


def completions_from_jsonl(path: Path) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["completion"], str(r.get("answer", r.get("reference")))) for r in rows]


def completions_from_tensorboard(folder: Path) -> tuple[list[tuple[str, str]], int]:
    """(completion, answer) of the `eval/samples` tables below `folder`, and how many were cut (left out: a cut
    completion may have lost its answer). The tables are training/evaluation.py's Markdown rows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows, cut = [], 0
    for events in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        tags = [t for t in acc.Tags().get("tensors", []) if t in ("eval/samples", "eval/samples/text_summary")]
        for event in (e for tag in tags for e in acc.Tensors(tag)):
            for line in event.tensor_proto.string_val[0].decode().splitlines()[2:]:
                cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
                if len(cells) != 3:
                    continue
                text = cells[2].strip().replace("<br>", "\n").replace("\\|", "|")
                if text.endswith("…"):
                    cut += 1
                else:
                    rows.append((text, cells[0].strip()))
    return rows, cut


GENERATE_BATCH = 16
"""Problems per generate call (left-padded): one at a time, 300 completions took over 20 minutes on 2 cores."""


def generate(count: int, overrides: list[str], max_new_tokens: int) -> list[tuple[str, str]]:
    """Greedy completions of the first `count` GSM8K test problems by the configured model (the embedded default
    unless `overrides` say otherwise), prompted as training prompts them."""
    import torch
    from hydra import compose, initialize_config_dir

    from grpo_lightning.app.build import build
    from grpo_lightning.app.parts import load_model

    with initialize_config_dir(config_dir=str(ROOT / "grpo_lightning" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    model, tokenizer = load_model(build(cfg.model.source), cfg)
    dataset = GSM8K(source="packaged", split="test")
    problems = dataset.load()[:count]
    tokenizer.padding_side = "left"  # batched greedy decoding: prompts end where generation starts
    out = []
    for start in range(0, len(problems), GENERATE_BATCH):
        batch = problems[start : start + GENERATE_BATCH]
        texts = [
            tokenizer.apply_chat_template(dataset.messages(p.question), tokenize=False, add_generation_prompt=True)
            for p in batch
        ]
        ids = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            tokens = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        width = ids["input_ids"].shape[1]
        replies = tokenizer.batch_decode(tokens[:, width:], skip_special_tokens=True)
        out += [(reply, p.answer) for reply, p in zip(replies, batch, strict=True)]
        print(f"generated {len(out)} / {len(problems)}", file=sys.stderr, flush=True)
    return out


# ---- report ---------------------------------------------------------------------------------------------------------
def accuracy_table(verdicts: list[Verdicts]) -> list[str]:
    lines = ["| checker | correct | rate |", "|---|---|---|"]
    for key in CHECKERS:
        right = sum(getattr(v, key) for v in verdicts)
        lines.append(f"| {NAMES[key]} | {right} / {len(verdicts)} | {right / max(len(verdicts), 1):.3f} |")
    return lines


def disagreement_report(items: list[tuple[str, str]], verdicts: list[Verdicts], examples: int) -> list[str]:
    found: dict[str, list[tuple[str, str, Verdicts]]] = {}
    for (completion, answer), v in zip(items, verdicts, strict=True):
        if v.ours != v.math_verify:
            found.setdefault(classify(completion, v.math_verify_answer), []).append((completion, answer, v))
    total = sum(len(x) for x in found.values())
    lines = [f"ours and math-verify disagree on {total} of {len(items)}", "",
             "| class | count | ours right | math-verify right |", "|---|---|---|---|"]  # fmt: skip
    for name in sorted(found, key=lambda n: -len(found[n])):
        cases = found[name]
        lines.append(f"| {CLASSES[name]} | {len(cases)} | {sum(v.ours for _, _, v in cases)} | "
                     f"{sum(v.math_verify for _, _, v in cases)} |")  # fmt: skip
    for name, cases in found.items():
        lines += ["", f"### {name}: {CLASSES[name]}"]
        for completion, answer, v in cases[:examples]:
            shown = completion if len(completion) <= 400 else "…" + completion[-400:]
            said = (
                f"ours read {v.ours_answer!r} ({v.ours}), math-verify read {v.math_verify_answer!r} ({v.math_verify})"
            )
            lines += ["", f"reference {answer}: {said}", "", "    " + shown.replace("\n", "\n    ")]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=Path, help="JSONL of {completion, answer} rows")
    parser.add_argument("--tensorboard", type=Path, help="a folder of runs: their eval/samples tables")
    parser.add_argument("--generate", type=int, default=0, help="generate this many completions (slow on a CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="with --generate")
    parser.add_argument(
        "--save-completions", type=Path, help="write the completions read here (JSONL, --completions reads it)"
    )
    parser.add_argument("--override", action="append", default=[], help="with --generate: a config override")
    parser.add_argument("--examples", type=int, default=3, help="examples printed per disagreement class")
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()

    refs = reference_solutions()
    splits = Counter(split for split, _, _ in refs)
    count = f"{len(refs)}: train {splits['train']} + test {splits['test']}"
    lines_only = [("####" + solution.rsplit("####", 1)[1], answer) for _, solution, answer in refs]
    line_verdicts = [judge(line, answer) for line, answer in lines_only]
    agree = all(v.ours and v.math_verify for v in line_verdicts)
    lines = [f"## GSM8K reference answers: each solution's `#### n` line against its answer ({count})", ""]
    lines += [*accuracy_table(line_verdicts), "", *disagreement_report(lines_only, line_verdicts, args.examples)]
    full = [(solution, answer) for _, solution, answer in refs]
    full_verdicts = [judge(solution, answer) for solution, answer in full]
    lines += ["", f"## GSM8K reference solutions: the whole solution against its answer ({count})", ""]
    lines += [*accuracy_table(full_verdicts), "", *disagreement_report(full, full_verdicts, args.examples)]

    items: list[tuple[str, str]] = []
    source = []
    if args.completions:
        items += completions_from_jsonl(args.completions)
        source.append(str(args.completions))
    if args.tensorboard:
        rows, cut = completions_from_tensorboard(args.tensorboard)
        items += rows
        source.append(f"eval/samples below {args.tensorboard} ({cut} cut completions left out)")
    if args.generate:
        items += generate(args.generate, args.override, args.max_new_tokens)
        source.append(f"{args.generate} greedy completions ({' '.join(args.override) or 'embedded default'})")
    if items:
        verdicts = [judge(completion, answer) for completion, answer in items]
        lines += ["", f"## Model completions ({len(items)}: {'; '.join(source)})", "", *accuracy_table(verdicts)]
        lines += ["", *disagreement_report(items, verdicts, args.examples)]
        lines += ["", *reading_report(items, verdicts, args.examples)]
        if args.save_completions:
            with args.save_completions.open("w", encoding="utf-8") as f:
                f.writelines(json.dumps({"completion": c, "answer": a}) + "\n" for c, a in items)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    if not agree:
        print("reference answers: ours and math-verify do not both accept every `#### n` line", file=sys.stderr)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
