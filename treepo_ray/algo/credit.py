"""Credit assignment over a batch of scored trees: each algorithm's advantages, DAPO's filter, the batch's statistics.

Every algorithm starts from trees whose trajectory rewards are set (Tree.set_trajectory_rewards); i.i.d. sampling is
a tree too (a root with G chains), so one code path serves all of them. The result is one advantage per trajectory
(a number for its whole response, or one per response token), which the learner turns into training samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from treepo_ray.algo.advantages import dapo_keep_group, grpo_advantages, treepo_scores, whiten
from treepo_ray.algo.treerpo import treerpo_advantages
from treepo_ray.tree.growth import growth_counters
from treepo_ray.tree.tree import Tree

ALGORITHMS = ("grpo", "dapo", "treepo", "treepo_flat", "treerpo", "catpo")

Advantage = float | list[float]
"""Of one trajectory: one number for its whole response, or one per response token."""

TREEPO_SCALES = ("batch", "prompt")
"""How TreePO scales its subgroup scores: one whitening over the batch, or per prompt by its reward std."""
PROMPT_STD_EPS = 1e-6  # GRPO's epsilon (grpo_advantages): an all-equal prompt scores 0, not a division by 0

PER_NODE = ("treerpo", "catpo")
"""Algorithms whose loss counts each node once (CATPO eq. 7), from per-node advantages."""


@dataclass
class TreeCredit:
    """One tree's credit, as the learner takes it."""

    trajectories: list[Advantage]
    """Every trajectory's advantage (tree_advantages): what the per-trajectory losses train on."""
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


def tree_advantages(trees: list[Tree], algorithm: str, *, treepo_weighting: str, whiten_by_tokens: bool,
                    grpo_scale: bool, treerpo_prune_range: float, treepo_root_group: bool = True,
                    treepo_subgroup_rejection: bool = False, treepo_scale: str = "batch") -> list[list[Advantage]]:
    """The advantage of every trajectory of every tree (`out[t][k]`: tree t's k-th trajectory).

    treepo: TreePO eq. 5 numerator per prompt, then with `treepo_scale` 'batch' one whitening over the whole batch
    (the official script; weighted by tokens when `whiten_by_tokens`, so the token-mean loss sees zero-mean
    unit-variance advantages), with 'prompt' each prompt's scores divided by the std of its rewards (GRPO's
    per-group scale: a prompt with one success in 16 weighs as much as one with eight). treerpo and catpo: every
    token of a node's segment gets that node's sibling-relative advantage (CATPO's credit is TreeRPO's; its tree
    weights are applied by the caller). grpo, dapo, treepo_flat: one flat group per prompt (Shao et al. 2024).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {ALGORITHMS}")
    if algorithm == "treepo":
        if treepo_scale not in TREEPO_SCALES:
            raise ValueError(f"treepo_scale must be one of {TREEPO_SCALES}, got {treepo_scale!r}")
        scores, lengths = [], []
        for tree in trees:
            scores.append(treepo_scores(tree.trajectory_paths(), trajectory_rewards(tree), weighting=treepo_weighting,
                                        include_root=treepo_root_group,
                                        skip_uniform_subgroups=treepo_subgroup_rejection))
            lengths += [len(tree.response_ids(n)) for n in tree.trajectories]
        if treepo_scale == "prompt":
            return [(s / (trajectory_rewards(tree).std() + PROMPT_STD_EPS)).tolist() for tree, s in zip(trees, scores)]
        flat = [s for per_tree in scores for s in per_tree]
        if not flat:
            return [[] for _ in trees]
        adv = iter(whiten(flat, weights=lengths if whiten_by_tokens else None).tolist())
        return [[next(adv) for _ in per_tree] for per_tree in scores]
    if algorithm in ("treerpo", "catpo"):
        return [_treerpo_token_advantages(tree, treerpo_prune_range) for tree in trees]
    return [grpo_advantages(trajectory_rewards(tree), scale=grpo_scale).tolist() for tree in trees]


def tree_credit(trees: list[Tree], algorithm: str, **settings) -> list[TreeCredit]:
    """Each tree's credit: the trajectories' advantages (tree_advantages, same settings) and, for TreeRPO and
    CATPO, each node's advantage and whether it takes part in the per-node loss."""
    per_trajectory = tree_advantages(trees, algorithm, **settings)
    if algorithm not in PER_NODE:
        return [TreeCredit(a) for a in per_trajectory]
    out = []
    for tree, traj in zip(trees, per_trajectory):
        adv, mask = _treerpo_node_advantages(tree, settings["treerpo_prune_range"])
        out.append(TreeCredit(traj, adv.tolist(), mask.tolist()))
    return out


def _treerpo_node_advantages(tree: Tree, prune_range: float) -> tuple[np.ndarray, np.ndarray]:
    """Each node's sibling-relative advantage and its mask (False where the sibling group is pruned)."""
    rewards = np.array(tree.reward, dtype=np.float64)
    on_path = sorted({n for p in tree.trajectory_paths() for n in p} | {0})
    if np.isnan(rewards[on_path]).any():
        raise ValueError(f"tree {tree.query_id!r}: a node on a trajectory has no propagated reward")
    rewards = np.nan_to_num(rewards, nan=0.0)  # nodes off every trajectory are never trained
    return treerpo_advantages(tree.parent, rewards, prune_range=prune_range)


def _treerpo_token_advantages(tree: Tree, prune_range: float) -> list[list[float]]:
    """Per trajectory, each token's node advantage (0 where the sibling group is pruned)."""
    adv, mask = _treerpo_node_advantages(tree, prune_range)
    node_adv = np.where(mask, adv, 0.0)
    return [[float(node_adv[n]) for n in tree.path(end) for _ in tree.tokens[n]] for end in tree.trajectories]


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
    }
    if response_limit and lengths:
        out["response_length/clip_ratio"] = float(np.mean([n >= response_limit for n in lengths]))
    growth = [t.meta.get("growth", {}) for t in trees]
    for key in ("branches", "fallbacks"):
        out[f"tree/{key}"] = float(np.mean([g.get(key, 0) for g in growth]))
    out.update(growth_counters(trees))  # growth/<mechanism>, stop reasons included: this batch's totals
    return out


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
