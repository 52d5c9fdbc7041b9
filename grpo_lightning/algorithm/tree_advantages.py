"""Per-token credit from STORPO's branches: each segment of a branched group gets V(end) - V(start).

A branched STORPO group is a chain tree: one initial completion (branch point 0) and continuations branched from
its prefixes at token counts 0 < b_1 < ... < b_n. Every completion through prefix b (the initial one and every
continuation branched at b or later) estimates that prefix's value, so

    V(root) = mean over the whole group,  V(b_j) = mean over {initial} + {continuations with branch point >= b_j}

and, as in VinePPO (Kazemnejad et al. 2024, arXiv 2410.01679) and SPO-chain (Guo et al. 2025, arXiv 2505.23564),
each token gets the Monte-Carlo advantage of the segment it lies in:

    initial completion, tokens [b_j, b_j+1):   V(b_j+1) - V(b_j)        (b_0 = root, b_n+1 = its own leaf)
    continuation from b_j, tokens from b_j on: A_c - V(b_j)             (the tokens before b_j are not trained)

where a leaf's value is its scalar advantage A (the reward pipeline's group transforms applied to the rewards, so
`GroupNormalize`'s scale carries over: for an affine transform the values above are the reward values, scaled).
Along any completion the segment advantages telescope to A - V(root), the flat group's advantage: the tree moves
credit between a completion's segments, towards the ones after which the outcome changed, and adds none.

Pure: imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_tree_advantages(
    advantages: Sequence[float],
    branch_points: Sequence[int],
    lengths: Sequence[int],
) -> list[list[float]]:
    """Per-token advantages of one branched group, one list per completion (its length), in the input order.

    `advantages`: each completion's scalar advantage (the leaf values); `branch_points`: 0 for the initial
    completion (exactly one), the prefix length it was branched from for a continuation; `lengths`: completion
    tokens (a continuation's include the shared prefix). A continuation's tokens before its branch point get 0.
    """
    n = len(advantages)
    if not n == len(branch_points) == len(lengths):
        raise ValueError(f"one advantage, branch point and length per completion (got {n}, {len(branch_points)}, "
                         f"{len(lengths)})")  # fmt: skip
    roots = [i for i, b in enumerate(branch_points) if b == 0]
    if len(roots) != 1:
        raise ValueError(f"a branched group has exactly one initial completion (branch point 0); got {len(roots)}")
    root = roots[0]
    if any(b >= lengths[root] for b in branch_points):
        raise ValueError(f"branch points {list(branch_points)} must lie inside the initial completion "
                         f"({lengths[root]} tokens)")  # fmt: skip
    points = sorted(set(branch_points) - {0})  # b_1 < ... < b_n

    def value(b: int) -> float:  # V(b): mean over every completion whose prefix includes the first b tokens
        through = [a for a, k in zip(advantages, branch_points, strict=True) if k == 0 or k >= b]
        return sum(through) / len(through)

    values = {b: value(b) for b in [0, *points]}  # V(root) = V(0): the whole group
    out: list[list[float]] = []
    for i, (a, k, length) in enumerate(zip(advantages, branch_points, lengths, strict=True)):
        if i == root:
            starts, ends = [0, *points], [*points, length]
            ends_value = [*(values[b] for b in points), a]  # the last segment ends in the initial's own leaf
            tokens: list[float] = []
            for start, end, v_end in zip(starts, ends, ends_value, strict=True):
                tokens.extend([v_end - values[start]] * (end - start))
            out.append(tokens)
        else:
            out.append([0.0] * k + [a - values[k]] * (length - k))
    return out
