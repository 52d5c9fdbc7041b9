"""Per-token credit from STORPO's branches: each segment of a completion gets V(end) - V(start), every value a
Monte-Carlo estimate from samples that do not contain the segment it credits.

A STORPO group is a forest: T initial completions of one prompt (branch point 0, one per tree), each with
continuations branched from its own prefixes at token counts 0 < b_1 < ... < b_n. Every completion's scalar
advantage A (the reward pipeline's group transforms) is its leaf value. For tree t:

    V(b_j)  = the mean of A over the continuations branched at b_j   (fresh samples from that prefix)
    V(root) = the mean of A over every completion of the OTHER trees (when the transforms centre each group on
              its mean), else 0 (a transform with a baseline of its own, the EMA or the batch mean, or none)

    initial completion, tokens [b_j, b_j+1):  V(b_j+1) - V(b_j)     (b_0 = root; the last segment ends in A)
    continuation from b_j, tokens from b_j on: A - mean of A over the tree's other completions through b_j
                                               (the initial, the continuations at b_j and later, itself left out)

Why these values (VinePPO, Kazemnejad et al. 2024, arXiv 2410.01679: values from rollouts independent of the path
they credit). A segment's start value must not contain the segment: every completion through b_j+1 shares the
initial's tokens [b_j, b_j+1), so a value at b_j averaged over them (the through-mean) is pulled towards the
segment's own outcome, and the segment advantage shrinks to K / (N_j+1 + K) of V(b_j+1) - (the continuations at
b_j), with K continuations a point and N_j+1 completions through b_j+1. The continuations at b_j re-sample
everything after b_j: E[V(b_j) | prefix b_j] is the prefix's value, with variance sigma^2(b_j) / K. Along the
initial completion the advantages telescope to A - V(root): the credit moves between its segments and adds none.
A continuation's baseline is a leave-one-out mean (RLOO's) over samples from its branch point.

The root: a forest's other trees are samples from the root that do not share tree t's first segment, so the first
segment is credited V(b_1) - V(root), not 0 as in a single tree valued by its own mean. In A's units V(root) is the
transforms' own baseline: `GroupNormalize` subtracts the group mean, whose leave-one-tree-out form is the other
trees' mean (one tree: 0, the group mean); `EMABaseline` and `BatchNormalize` subtract a baseline from outside the
group, so the root is worth 0 and A - V(root) = A keeps it. Related work: SPO-chain (Guo et al. 2025, arXiv
2505.23564), TreeRL (arXiv 2506.11902).

Pure: imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def forest_advantages(
    advantages: Sequence[float],
    branch_points: Sequence[int],
    trees: Sequence[int],
    lengths: Sequence[int],
    root_from_other_trees: bool,
) -> list[list[float]]:
    """Per-token advantages of one STORPO group, one list per completion (its length), in the input order.

    `advantages`: each completion's scalar advantage (its leaf value); `branch_points`: 0 for a tree's initial
    completion (one per tree), the prefix length it was branched from for a continuation; `trees`: the tree each
    completion belongs to; `lengths`: completion tokens (a continuation's include the shared prefix);
    `root_from_other_trees`: value the root by the other trees (transforms that centre on the group mean), else 0.
    A continuation's tokens before its branch point get 0.
    """
    n = len(advantages)
    if not n == len(branch_points) == len(trees) == len(lengths):
        raise ValueError(
            f"one advantage, branch point, tree and length per completion (got {n}, {len(branch_points)}, "
            f"{len(trees)}, {len(lengths)})"
        )
    members: dict[int, list[int]] = {}
    for i, tree in enumerate(trees):
        members.setdefault(tree, []).append(i)
    out: list[list[float]] = [[] for _ in range(n)]
    for tree, indices in members.items():
        roots = [i for i in indices if branch_points[i] == 0]
        if len(roots) != 1:
            raise ValueError(f"tree {tree} needs exactly one initial completion (branch point 0); got {len(roots)}")
        root = roots[0]
        if any(branch_points[i] >= lengths[root] for i in indices):
            raise ValueError(
                f"tree {tree}'s branch points {[branch_points[i] for i in indices]} must lie inside its initial "
                f"completion ({lengths[root]} tokens)"
            )
        others = [advantages[i] for i in range(n) if trees[i] != tree]
        v_root = _mean(others) if root_from_other_trees and others else 0.0
        points = sorted({branch_points[i] for i in indices} - {0})  # b_1 < ... < b_n
        at = {b: _mean([advantages[i] for i in indices if branch_points[i] == b]) for b in points}
        values = [v_root, *(at[b] for b in points), advantages[root]]  # root, b_1 .. b_n, the initial's leaf
        for j, (start, end) in enumerate(zip([0, *points], [*points, lengths[root]], strict=True)):
            out[root].extend([values[j + 1] - values[j]] * (end - start))
        for i in indices:
            k = branch_points[i]
            if i == root:
                continue
            through = [advantages[j] for j in indices if j != i and (branch_points[j] == 0 or branch_points[j] >= k)]
            out[i] = [0.0] * k + [advantages[i] - _mean(through)] * (lengths[i] - k)
    return out
