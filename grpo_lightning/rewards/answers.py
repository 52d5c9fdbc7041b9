"""Where the answer is in a reply: the format a prompt asks for (strict), and the last number (format-free).

Two readers, two rules:

* the **reward** reads the answer in the format the prompt asked for, and nothing else (`extract_answer`):
  GRPO then rewards the format as well as the answer, the way DeepSeek-R1's rule-based rewards do (Guo et al.
  2025, "DeepSeek-R1", §2.2.2: an accuracy reward on the answer in a specified format, e.g. a box);
* the **evaluation** a researcher quotes must not depend on that format (docs/data.md): a policy that learns
  to write `<answer>` tags has not learnt arithmetic, and one that answers right in another format has. It reads
  the LAST NUMBER of the reply (`last_number`), the usual format-free reading of numeric answers (Cobbe et al.
  2021's GSM8K verifier baselines take the last number; so does lm-evaluation-harness's "flexible-extract").

The formats (`FORMATS`), each read from its LAST occurrence in the reply (models restate and revise):

| name | written | read |
|---|---|---|
| `tag` | `<answer>42</answer>` | the text between the tags, stripped |
| `hash` | `#### 42` | the rest of the line after `####`, stripped (GSM8K's reference format) |
| `boxed` | `\\boxed{42}` | the text inside the braces (nested braces kept), stripped |
| `plain` | `42` | the whole reply, stripped: for tasks whose verifier reads the full reply |

Pure standard library, like every module of the reward layer that a term uses.
"""

from __future__ import annotations

import re

from grpo_lightning.rewards.gsm8k import _NUMBER, normalize_number

FORMATS = ("tag", "hash", "boxed", "plain")

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_BOXED = "\\boxed{"
_LAST_NUMBER = re.compile(_NUMBER)


def extract_answer(text: str, answer_format: str) -> str | None:
    """The answer written in `answer_format` (the last one), stripped; None when the reply has none (or it is
    empty)."""
    if answer_format not in FORMATS:
        raise ValueError(f"answer format must be one of {', '.join(FORMATS)} (got {answer_format!r})")
    found = {"tag": _last_tag, "hash": _last_hash, "boxed": _last_boxed, "plain": str.strip}[answer_format](text)
    return found or None


def extract_any(text: str) -> str | None:
    """The answer in whichever of tag, hash and boxed starts last in the reply; None when none is there."""
    found = [(start, value) for start, value in (_tag_at(text), _hash_at(text), _boxed_at(text)) if value]
    return max(found)[1] if found else None


def last_number(text: str) -> str | None:
    """The last number written in the reply (optional minus, decimals, thousands commas removed), or None."""
    matches = _LAST_NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def is_numeric(answer: str) -> bool:
    """Whether a reference answer is a plain number (then `last_number` is its format-free reading)."""
    return normalize_number(answer) is not None


def format_answer(answer: str, answer_format: str) -> str:
    """`answer` written in `answer_format`: the reference solution a dry run scores (it must score 1)."""
    return {"tag": f"<answer>{answer}</answer>", "hash": f"#### {answer}", "boxed": f"\\boxed{{{answer}}}",
            "plain": answer}[answer_format]  # fmt: skip


# ---- each format: (start of the last occurrence, its answer) ------------------------------------------------------
def _tag_at(text: str) -> tuple[int, str | None]:
    matches = list(_TAG.finditer(text))
    return (matches[-1].start(), matches[-1].group(1).strip()) if matches else (-1, None)


def _hash_at(text: str) -> tuple[int, str | None]:
    matches = list(_HASH.finditer(text))
    return (matches[-1].start(), matches[-1].group(1).strip()) if matches else (-1, None)


def _boxed_at(text: str) -> tuple[int, str | None]:
    """The last `\\boxed{...}` whose braces close; its content with nested braces kept."""
    start = text.rfind(_BOXED)
    while start >= 0:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return start, text[start + len(_BOXED) : i - 1].strip()
        start = text.rfind(_BOXED, 0, start)
    return -1, None


def _last_tag(text: str) -> str | None:
    return _tag_at(text)[1]


def _last_hash(text: str) -> str | None:
    return _hash_at(text)[1]


def _last_boxed(text: str) -> str | None:
    return _boxed_at(text)[1]
