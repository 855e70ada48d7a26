"""TreeRPO (Yang et al. 2025): N-ary trees of depth D, every node's advantage against its siblings; CATPO's credit.

    sampler    treerpo (rollout.treerpo: n_children per node, max_depth steps of step_len tokens)
    credit     per node (r - mu) / (mu (1 - mu) + eps) over its siblings, rewards propagated bottom-up as means
               (algo.treerpo: sibling groups whose reward range stays within prune_range take no part)
    per_node   the loss counts each node once (CATPO eq. 7: node-mean), every token of a node with its advantage
    loss       PPO clip 0.2 / 0.2 with a k3 KL of 0.001 (CATPO appendix B), node-mean

The node math below takes a tree as `parent`: an int array with parent[0] = -1 (node 0 is the root, i.e. the prompt) and
0 <= parent[i] < i for every other node, so children always come after their parent. A leaf is a node with no
children (a root without children is itself a leaf). A tree always has a root, so an empty `parent` raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treepo_ray.algo._checks import finite_1d, has_children, parent_array
from treepo_ray.algo.credit import Advantage, TreeCredit
from treepo_ray.algo.grpo import PPO_KL
from treepo_ray.algo.spec import Algorithm
from treepo_ray.tree.tree import Tree


def leaf_mask(parent) -> np.ndarray:
    """Boolean mask over the nodes of the tree: True at leaves (nodes without children)."""
    return ~has_children(parent_array(parent))


def propagate_rewards(parent, leaf_rewards) -> np.ndarray:
    """Every node's reward, a leaf keeping its own and an inner node taking the mean of its children's.

    TreeRPO / CATPO eq. 1: r_node = E_{c in children}[r_c], applied bottom-up. `leaf_rewards` is a float array
    over all nodes; only the values at leaves are read (anything, NaN included, may sit at inner nodes), and a
    NaN/inf at a leaf raises ValueError naming the node.
    """
    par = parent_array(parent)
    given = np.asarray(leaf_rewards, dtype=np.float64)
    if given.shape != par.shape:
        raise ValueError(f"leaf_rewards has shape {given.shape} but the tree has {par.size} nodes")
    inner = has_children(par)
    bad = np.flatnonzero(~inner & ~np.isfinite(given))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"leaf_rewards[{i}] is {given[i]} at leaf node {i}; leaf rewards must be finite")
    out = np.where(inner, 0.0, given)
    child_sum = np.zeros(par.size)
    child_count = np.zeros(par.size)
    # Children have larger ids than their parent, so a reverse sweep finishes every child before its parent.
    for i in range(par.size - 1, 0, -1):
        if inner[i]:
            out[i] = child_sum[i] / child_count[i]
        child_sum[par[i]] += out[i]
        child_count[par[i]] += 1
    if inner[0]:
        out[0] = child_sum[0] / child_count[0]
    return out


def treerpo_advantages(
    parent, node_rewards, eps: float = 1e-6, prune_range: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """TreeRPO advantage of every node over its sibling group, and the mask of nodes that take part.

    TreeRPO (Yang et al. 2025), CATPO eq. 2: A_n = (r_n - mu) / (mu (1 - mu) + eps), mu the mean reward of
    n and its siblings (all children of n's parent). Bernoulli variance mu(1 - mu) stands in for the std, so
    `node_rewards` (the propagated rewards, see `propagate_rewards`) must lie in [0, 1]; anything else raises.
    The mask is True where the sibling group's reward range (max - min) exceeds `prune_range` (CATPO/TreeRPO
    tau_prune = 0.1). The root gets advantage 0 and mask False. Both arrays are over all nodes.
    """
    par = parent_array(parent)
    r = finite_1d("node_rewards", node_rewards)
    if r.shape != par.shape:
        raise ValueError(f"node_rewards has shape {r.shape} but the tree has {par.size} nodes")
    out_of_range = np.flatnonzero((r < 0) | (r > 1))
    if out_of_range.size:
        i = int(out_of_range[0])
        raise ValueError(f"node_rewards[{i}] = {r[i]}; TreeRPO's Bernoulli normalisation needs rewards in [0, 1]")
    adv = np.zeros(par.size)
    mask = np.zeros(par.size, dtype=bool)
    if par.size == 1:
        return adv, mask
    kids, pk = np.arange(1, par.size), par[1:]
    mu = np.bincount(pk, weights=r[1:], minlength=par.size) / np.maximum(np.bincount(pk, minlength=par.size), 1)
    hi = np.full(par.size, -np.inf)
    lo = np.full(par.size, np.inf)
    np.maximum.at(hi, pk, r[1:])
    np.minimum.at(lo, pk, r[1:])
    m = mu[pk]
    # Equal siblings get exactly 0 (their mean, summed in floating point, can miss their common value by an ulp).
    adv[kids] = np.where(hi[pk] > lo[pk], (r[1:] - m) / (m * (1.0 - m) + eps), 0.0)
    mask[kids] = (hi[pk] - lo[pk]) > prune_range
    return adv, mask


# ---------------------------------------------------------------------------------------------- the algorithm


@dataclass
class TreeRPOCreditConfig:
    """algo.treerpo: TreeRPO's credit (also CATPO's)."""

    prune_range: float = 0.1
    """A sibling group takes part only if its reward range reaches this (tau_prune)."""


def node_advantages(tree: Tree, prune_range: float) -> tuple[np.ndarray, np.ndarray]:
    """Each node's sibling-relative advantage and its mask (False where the sibling group is pruned)."""
    rewards = np.array(tree.reward, dtype=np.float64)
    on_path = sorted({n for p in tree.trajectory_paths() for n in p} | {0})
    if np.isnan(rewards[on_path]).any():
        raise ValueError(f"tree {tree.query_id!r}: a node on a trajectory has no propagated reward")
    rewards = np.nan_to_num(rewards, nan=0.0)  # nodes off every trajectory are never trained
    return treerpo_advantages(tree.parent, rewards, prune_range=prune_range)


class TreeRPO(Algorithm):
    name = "treerpo"
    sampler = "treerpo"
    loss = {**PPO_KL, "aggregation": "node-mean"}
    per_node = True

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        """Per trajectory, each token's node advantage (0 where the sibling group is pruned)."""
        out = []
        for tree in trees:
            adv, mask = node_advantages(tree, cfg.treerpo.prune_range)
            node_adv = np.where(mask, adv, 0.0)
            out.append([[float(node_adv[n]) for n in tree.path(end) for _ in tree.tokens[n]]
                        for end in tree.trajectories])
        return out

    def tree_credit(self, trees: list[Tree], cfg) -> list[TreeCredit]:
        out = []
        for tree, traj in zip(trees, self.advantages(trees, cfg)):
            adv, mask = node_advantages(tree, cfg.treerpo.prune_range)
            out.append(TreeCredit(traj, adv.tolist(), mask.tolist()))
        return out
