"""Markdown for the reference page's cells: a yaml comment as table text (code in backticks, docs/ paths as
links), a composed value as yaml writes it, and tables."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DOC_LINK = re.compile(r"^docs/([\w.-]+\.md)$")
CODE_SPAN = re.compile(r"(`[^`]*`)")
CODE_LIKE = re.compile(r"[_=<|{$*]|\w>|>\w")
DOTTED = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_<*][\w<>*-]*)+$")  # eval.seed, torch.optim, last.ckpt
PATH = re.compile(r"^[\w.<>-]+(/[\w.<>*-]*)+$")  # policy/merged/, generator/sampling.yaml
NOT_CODE = {"->", "<-", ">", "<", ">=", "<=", "=", "|", "*", "x", "e.g", "i.e"}


def _token(token: str, link_dir: Path | None) -> str:
    """One whitespace-free word of a comment, as markdown: a docs/ path becomes a link, code goes in backticks."""
    lead = re.match(r"^[(\"']*", token).group()
    core = token[len(lead) :]
    trail = ""
    while core and core[-1] in ",.;:)\"'":
        if core[-1] == ")" and core.count("(") >= core.count(")"):
            break
        trail, core = core[-1] + trail, core[:-1]
    if core.endswith("'s"):  # custom_decode's
        core, trail = core[:-2], "'s" + trail
    link = DOC_LINK.match(core)
    if link is not None and link_dir is not None and (link_dir / link[1]).is_file():
        return f"{lead}[{link[1]}]({link[1]}){trail}"
    code = CODE_LIKE.search(core) or DOTTED.match(core) or re.match(r"^[+~][A-Za-z]", core)
    path = PATH.match(core) and (core.endswith("/") or re.search(r"\.\w+$", core))
    if core and core not in NOT_CODE and (code or path):
        return f"{lead}`{core}`{trail}"
    return token


def markdown_text(text: str, link_dir: Path | None = None) -> str:
    """A yaml comment as the text of a table cell: code in backticks, docs/ paths as links, `|` escaped."""
    parts = []
    for part in CODE_SPAN.split(text):
        if not part.startswith("`"):
            part = "".join(_token(t, link_dir) if t.strip() else t for t in re.split(r"(\s+)", part))
        parts.append(part)
    return "".join(parts).replace("|", "\\|")


def format_value(value: Any) -> str:
    """A composed value as yaml writes it, e.g. `null`, `true`, `[0.9, 0.99]`, `${generator.max_new_tokens}`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value.replace("\n", "\\n") if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def code_cell(value: Any) -> str:
    return "`" + format_value(value).replace("|", "\\|") + "`"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
