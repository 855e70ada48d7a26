"""What every algorithm's credit assignment shares: the credit type the learner takes, the trajectory rewards,
DAPO's filter and the batch's statistics. Each algorithm's own advantages are in its file (grpo.py, treepo.py,
treerpo.py; spec.py says what an algorithm is).

Every algorithm starts from trees whose trajectory rewards are set (Tree.set_trajectory_rewards); i.i.d. sampling is
a tree too (a root with G chains), so one code path serves all of them. The result is one advantage per trajectory
(a number for its whole response, or one per response token), which the learner turns into training samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from treepo_ray.algo.advantages import dapo_keep_group
from treepo_ray.tree.growth import growth_counters
from treepo_ray.tree.tree import Tree

Advantage = float | list[float]
"""Of one trajectory: one number for its whole response, or one per response token."""


@dataclass
class TreeCredit:
    """One tree's credit, as the learner takes it."""

    trajectories: list[Advantage]
    """Every trajectory's advantage (Algorithm.advantages): what the per-trajectory losses train on."""
    nodes: list[float] | None = None
    """Per-node algorithms: each node's advantage (0 for the root)."""
    node_mask: list[bool] | None = None
    """Per-node algorithms: the nodes that take part in the loss (TreeRPO's pruning; False for the root)."""


def trajectory_rewards(tree: Tree) -> np.ndarray:
    r = np.array([tree.reward[n] for n in tree.trajectories], dtype=np.float64)
    if np.isnan(r).any():
        raise ValueError(f"tree {tree.query_id!r}: trajectory {int(np.flatnonzero(np.isnan(r))[0])} has no reward")
    return r


def keep_tree(tree: Tree) -> bool:
    """DAPO's filter (eq. 11): a prompt is kept only when its trajectories' rewards are not all equal."""
    return dapo_keep_group(trajectory_rewards(tree))


def tree_metrics(trees: list[Tree], correct_threshold: float = 1.0, response_limit: int | None = None) -> dict:
    """Rollout and tree statistics of a batch (reward, accuracy, lengths, depth, branching, early stops, sharing).
    verl's names where verl has the figure (metric_utils.compute_data_metrics): critic/score/* are the trajectory
    rewards, response_length/* the response lengths in tokens, response_length/clip_ratio the share of responses
    that reached `response_limit` (cut at the length limit)."""
    if not trees:
        return {}
    rewards = np.concatenate([trajectory_rewards(t) for t in trees])
    lengths = [len(t.response_ids(n)) for t in trees for n in t.trajectories]
    # Tokens of the distinct nodes on trajectories: what was generated for them with a perfect prefix cache.
    generated = sum(sum(len(t.tokens[n]) for n in {n for p in t.trajectory_paths() for n in p}) for t in trees)
    path_tokens = sum(lengths)
    out = {
        "critic/score/mean": float(rewards.mean()) if rewards.size else math.nan,
        "rollout/accuracy": float((rewards >= correct_threshold).mean()) if rewards.size else math.nan,
        "response_length/mean": float(np.mean(lengths)) if lengths else math.nan,
        "critic/score/max": float(rewards.max()) if rewards.size else math.nan,
        "critic/score/min": float(rewards.min()) if rewards.size else math.nan,
        "response_length/max": float(max(lengths)) if lengths else math.nan,
        "response_length/min": float(min(lengths)) if lengths else math.nan,
        "rollout/trajectories": float(len(lengths)),
        "rollout/prompts": float(len(trees)),
        "rollout/mixed_groups": float(np.mean([keep_tree(t) for t in trees])),
        "tree/nodes": float(np.mean([len(t) for t in trees])),
        "tree/depth_max": float(max(max(t.depth) for t in trees)),
        "tree/depth_mean": float(np.mean([max(t.depth) for t in trees])),
        # Share of trajectory tokens that were not generated separately because a prefix was shared.
        "tree/shared_prefix_share": 1.0 - generated / path_tokens if path_tokens else 0.0,
        "tree/unique_tokens": float(sum(t.unique_tokens() for t in trees)),
        "rollout/sampled_tokens": float(sampled_tokens(trees)),
    }
    if response_limit and lengths:
        out["response_length/clip_ratio"] = float(np.mean([n >= response_limit for n in lengths]))
    growth = [t.meta.get("growth", {}) for t in trees]
    for key in ("branches", "fallbacks"):
        out[f"tree/{key}"] = float(np.mean([g.get(key, 0) for g in growth]))
    out.update(growth_counters(trees))  # growth/<mechanism>, stop reasons included: this batch's totals
    return out


def sampled_tokens(trees: list[Tree]) -> int:
    """Tokens generated for these trees: every sampled segment plus what healing generated (critiques and
    continuations, algo/catpo.py); grafted segments are counted once, as part of healing's generated tokens."""
    total = 0
    for t in trees:
        grafted = set(t.meta.get("grafted", []))
        total += sum(len(t.tokens[n]) for n in range(1, len(t)) if n not in grafted)
        total += t.meta.get("catpo", {}).get("heal", {}).get("generated_tokens", 0)
    return total


def advantage_metrics(trees: list[Tree], advantages: list[list[Advantage]], weights: list[float] | None = None) -> dict:
    """critic/advantages/mean, max, min as verl computes them: over every response token of the batch (a
    trajectory's scalar advantage counts once per token), after CATPO's tree weights when given."""
    values = []
    for t, tree in enumerate(trees):
        w = 1.0 if weights is None else float(weights[t])
        for node, adv in zip(tree.trajectories, advantages[t]):
            if isinstance(adv, list):
                values.extend(a * w for a in adv)
            else:
                values.extend([adv * w] * len(tree.response_ids(node)))
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {"critic/advantages/mean": float(a.mean()), "critic/advantages/max": float(a.max()),
            "critic/advantages/min": float(a.min())}
