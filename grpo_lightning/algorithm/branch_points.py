"""Where STORPO branches: token counts k (0 < k < len(completion)) of one sampled completion, by rule.

A branch point k means "continue from `prompt_ids + completion_ids[:k]`": the continuation re-samples token k and
everything after it. Two families of rules (docs/algorithm.md, "Where STORPO branches"):

* Text rules (`sentence`, `line`, `both`) find reasoning-step boundaries in the decoded text and map them to token
  counts. They depend on how the model writes: a one-line reply has none.
* Token rules (`uncertainty`, `fixed`) need nothing but the completion's length and the log-probs the engine
  already returns, so every completion of at least two tokens branches, at min(count, length - 1) points.
  `uncertainty`: the tokens sampled with the highest -log p, at least a gap apart (TreeRL / EPTree, Hou et al.
  2025, arXiv 2506.11902: top-N of the sampled token's -log p with a minimum distance; SPO-chain, Guo et al. 2025,
  arXiv 2505.23564: low-probability cutpoints). `fixed`: evenly spaced offsets (fixed segments: TreePO, Li et al.
  2025, arXiv 2508.17445; SPO-tree).

Pure: no torch, no Lightning; `decode` is the tokenizer's.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence

STEP_BOUNDARY = re.compile(r"(?<![0-9])\.(?:\s+|\n+)(?=[A-Z0-9])")
"""A sentence that ends a step: a period not after a digit ("$1.50. Then" never splits), whitespace, then a
capital or a digit."""
LINE_BOUNDARY = re.compile(r"\n\s*(?=\S)")
"""A line that ends a step: a line break, then (after any blank lines and indentation) the next line's text. Small
models often write their steps as lines (`1. Multiply 5 by 3`), which the sentence rule never splits."""
TEXT_RULES = {"sentence": (STEP_BOUNDARY,), "line": (LINE_BOUNDARY,), "both": (STEP_BOUNDARY, LINE_BOUNDARY)}
"""The text rules: the patterns whose match ends mark where a new step starts."""
TOKEN_RULES = ("uncertainty", "fixed")
"""The token rules: branch points on every completion of at least two tokens."""
STEP_RULES = (*TEXT_RULES, *TOKEN_RULES)
"""Every value of `variant.step_rule`."""


def step_boundaries(text: str, rule: str = "sentence") -> list[int]:
    """Character offsets where a new reasoning step starts, ascending: the ends of the text `rule`'s matches
    (`both`: either rule's, once each). Every pattern looks ahead for the next step's text, so none is at the end."""
    return sorted({m.end() for pattern in TEXT_RULES[rule] for m in pattern.finditer(text)})


def split_steps(text: str, rule: str = "sentence") -> list[str]:
    """The reasoning steps of `text`: the pieces between consecutive step boundaries (they join back to it)."""
    cuts = [0, *step_boundaries(text, rule), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def token_boundaries(token_ids: Sequence[int], char_offsets: Sequence[int], decode: Callable) -> list[int]:
    """Map character offsets of decode(token_ids) to token counts k (0 < k < len(token_ids)), deduplicated.

    k is the largest prefix length whose decoded text is no longer than the offset, so the prefix ends at or
    before the boundary (a token like " Then" that straddles it goes to the continuation). Never re-tokenise the
    prefix text instead: BPE merges across the cut give other ids than the model sampled.
    """
    lengths, longest = [], 0
    for k in range(len(token_ids) + 1):
        longest = max(longest, len(decode(list(token_ids[:k]))))  # running max: decoded lengths never shrink
        lengths.append(longest)
    ks = []
    for offset in char_offsets:
        k = bisect.bisect_right(lengths, offset) - 1
        if 0 < k < len(token_ids) and k not in ks:
            ks.append(k)
    return ks


def evenly_spaced(items: Sequence[int], limit: int) -> list[int]:
    """At most `limit` items, spread evenly (the middle of each of `limit` equal slices)."""
    n = len(items)
    if n <= limit:
        return list(items)
    return [items[int((j + 0.5) * n / limit)] for j in range(limit)]


def widest_gap(length: int, count: int, min_gap: int) -> int:
    """The gap the branch points of a completion of `length` tokens keep: `min_gap` when min(count, length - 1)
    points fit in 1..length-1 that far apart ((n - 1) x gap <= length - 2), else the widest gap at which they do."""
    n = min(count, length - 1)
    return max(1, min_gap if n <= 1 else min(min_gap, (length - 2) // (n - 1)))


def room_left(picked: Sequence[int], gap: int, length: int) -> int:
    """How many more points fit in 1..length-1 at least `gap` from each other and from the sorted `picked`
    (packed from the left of each free stretch, which places the most)."""
    edges = [1 - gap, *picked, length - 1 + gap]  # virtual neighbours: a point may sit at 1 and at length - 1
    return sum(max(0, (right - left) // gap - 1) for left, right in zip(edges, edges[1:], strict=False))


def uncertainty_points(logprobs: Sequence[float], count: int, min_gap: int) -> list[int]:
    """The min(count, L - 1) branch points k whose sampled token k had the highest -log p, pairwise at least the
    gap apart, ascending (L = len(logprobs); k = 0 would be a fresh sample, not a branch, so 1 <= k <= L - 1).

    The gap is `min_gap` whenever the points fit that far apart, else the widest at which they fit
    (`widest_gap`). Greedy in order of -log p (ties: the earlier token), taking a candidate unless it lies closer
    than the gap to a point already taken (TreeRL's minimum distance) or would leave too little room for the points
    still to come (`room_left`): of all the placements that keep the gap, the one whose points rank highest, the
    first point first. A pure greedy pass, without the room check, can strand the last points (16 tokens, 4 points
    at gap 4: 9 and 15 first leave no room for two more), which is why the check is there.
    """
    if min_gap < 1:
        raise ValueError(f"min_gap must be >= 1 (got {min_gap!r})")
    length = len(logprobs)
    n = min(count, length - 1)
    if n <= 0:
        return []
    gap = widest_gap(length, count, min_gap)
    picked: list[int] = []
    for k in sorted(range(1, length), key=lambda k: (logprobs[k], k)):  # lowest log p (highest -log p) first
        if any(abs(k - j) < gap for j in picked):
            continue
        if room_left(sorted([*picked, k]), gap, length) < n - len(picked) - 1:
            continue
        picked.append(k)
        if len(picked) == n:
            return sorted(picked)
    raise AssertionError(f"no placement of {n} points at gap {gap} in {length} tokens")  # widest_gap rules it out


def fixed_points(length: int, count: int) -> list[int]:
    """min(count, length - 1) evenly spaced branch points: k_j = floor(j * L / (n + 1)), j = 1..n.

    The spacing L / (n + 1) is at least 1 because n <= L - 1, so the points are distinct and 1 <= k_j <= L - 1.
    """
    n = min(count, length - 1)
    return [j * length // (n + 1) for j in range(1, n + 1)] if n > 0 else []


def token_rule_points(rule: str, logprobs: Sequence[float], count: int, min_gap: int) -> list[int]:
    """The branch points of a token `rule` (`uncertainty` or `fixed`) on a completion with these log-probs."""
    if rule == "uncertainty":
        return uncertainty_points(logprobs, count, min_gap)
    if rule == "fixed":
        return fixed_points(len(logprobs), count)
    raise ValueError(f"not a token rule: {rule!r} (one of {', '.join(TOKEN_RULES)})")
