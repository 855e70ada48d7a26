"""Whether a tree's branches were worth their tokens: the share of branch points whose children ended differently.

A branch point is a node with two children or more (the root included) of which at least two hold a reward. It is
informative when its children's rewards (each child's mean over the trajectories below it, Tree.propagate_rewards)
are not all equal: only then do the siblings' advantages differ, so the branch taught the policy something. The
entropy at a branch point is that of the distribution its children's first tokens were drawn from (the same for
every child; read from the first child that reported entropies).
"""

from __future__ import annotations

import math
from collections import defaultdict

from treepo_ray.tree.tree import Tree

DEPTHS = 4
"""Per-depth figures for branch points at depths 0..DEPTHS-1; deeper ones count in the last."""


def branch_points(tree: Tree) -> list[tuple[int, list[int], bool]]:
    """(node, its children that hold a reward, informative) for every branch point of `tree` (see the module
    docstring), in node order."""
    children = defaultdict(list)
    for node in range(1, len(tree)):
        if not math.isnan(tree.reward[node]):
            children[tree.parent[node]].append(node)
    out = []
    for node in sorted(children):
        rewards = [tree.reward[c] for c in children[node]]
        if len(rewards) >= 2:
            out.append((node, children[node], max(rewards) - min(rewards) > 1e-9))
    return out


def branch_metrics(trees: list[Tree]) -> dict[str, float]:
    """A batch's branch figures, over every branch point of `trees`:

    tree/branch_points (their number), tree/informative_branches (the informative share),
    tree/informative_branches_depth{d} (that share among branch points at depth d; the last depth holds the deeper
    ones too), tree/tokens_per_informative_branch (the trees' sampled tokens over their informative branch points),
    tree/branch_entropy (mean entropy at branch points) and tree/token_entropy (mean over every sampled token); the
    entropies are NaN where the engine reported none. Shares are NaN without branch points."""
    points = informative = tokens = 0
    by_depth = [[0, 0] for _ in range(DEPTHS)]
    at_branch, all_tokens = [], []
    for tree in trees:
        tokens += sum(len(t) for t in tree.tokens)
        for e in tree.entropy:
            all_tokens.extend(e)
        for node, kids, good in branch_points(tree):
            points += 1
            informative += good
            d = by_depth[min(tree.depth[node], DEPTHS - 1)]
            d[0] += 1
            d[1] += good
            first = next((tree.entropy[c][0] for c in kids if tree.entropy[c]), None)
            if first is not None:
                at_branch.append(first)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    out = {"tree/branch_points": float(points),
           "tree/informative_branches": informative / points if points else math.nan,
           "tree/tokens_per_informative_branch": tokens / informative if informative else math.nan,
           "tree/branch_entropy": mean(at_branch), "tree/token_entropy": mean(all_tokens)}
    for d, (n, good) in enumerate(by_depth):
        out[f"tree/informative_branches_depth{d}"] = good / n if n else math.nan
    return out
