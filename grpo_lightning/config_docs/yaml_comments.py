"""The comments of a config file (conf/**/*.yaml): what the file says about itself and about each of its keys,
the meanings docs/configuration.md's tables show (config_docs/reference.py).

A key's comment is the inline `# ...` comment on the line that sets it, preceded by the comment lines directly
above the key; comment lines below it that start in the column of its inline `#` continue it. A node's comment
(`forward:   # ...`) is the node's own. A blank line ends the comment lines above a key. A file's leading comment
block describes the file itself (its `header`), never its first key; in it, an example line (`#   python -m ...`,
two or more spaces after the `#`) ends the prose, and `# @package` lines are Hydra's. A `#` inside quotes is part
of the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class YamlComments:
    """What a config file says about itself (`header`) and about each of its keys (`keys`, dotted)."""

    header: str = ""
    keys: dict[str, str] = field(default_factory=dict)


KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_][\w.\-]*|\"[^\"]*\"|'[^']*') *:(?=\s|$)(?P<rest>.*)$")
EXAMPLE_LINE = re.compile(r"^#\s{2,}")  # `#   python -m ...`: an example in a file header, not prose


def split_comment(text: str) -> tuple[str, str | None, int | None]:
    """(value, comment, offset of the `#`) of the rest of a yaml line; a `#` inside quotes is part of the value."""
    quote = None
    for i, char in enumerate(text):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1 :].strip(), i
    return text.strip(), None, None


def read_comments(path: Path) -> YamlComments:
    """The header and the per-key comments of one yaml file (the rules: the module docstring)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header, header_end = _header(lines)
    return YamlComments(header=header, keys=_key_comments(lines, header_end))


def _header(lines: list[str]) -> tuple[str, int]:
    """The file's leading comment block as prose (examples and `# @package` left out), and where it ends."""
    header_end = 0
    header: list[str] = []
    in_prose = True
    while header_end < len(lines) and lines[header_end].lstrip().startswith("#"):
        line = lines[header_end].strip()
        header_end += 1
        if line.startswith("# @package"):
            continue
        if EXAMPLE_LINE.match(line):
            in_prose = False
        if in_prose:
            header.append(line[1:].strip())
    return " ".join(h for h in header if h), header_end


def _key_comments(lines: list[str], start: int) -> dict[str, str]:
    """Each dotted key's comment, from line `start` on."""
    keys: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the open nodes
    above: list[str] = []  # comment lines directly above the next key
    continued: tuple[str, int] | None = None  # (key, column of its inline `#`): where aligned lines continue it
    for line in lines[start:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            if continued is not None and line.index("#") == continued[1] and not above:
                keys[continued[0]] = f"{keys[continued[0]]} {stripped[1:].strip()}".strip()
            else:
                above.append(stripped[1:].strip())
                continued = None
            continue
        match = KEY_LINE.match(line) if stripped else None
        if match is None:  # a blank line, a list item (the defaults list) or a continued value
            above, continued = [], None
            continue
        indent, key = len(match["indent"]), match["key"].strip("\"'")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        _, inline, offset = split_comment(match["rest"])
        text = " ".join([*above, inline or ""]).strip()
        if text:
            keys[dotted] = text
        above = []
        column = None if offset is None else match.start("rest") + offset
        continued = (dotted, column) if inline and column is not None else None
    return keys
