"""CATPO tree informativeness: score F(T), the four regimes of Table 1, and the loss weights w(T)."""

from __future__ import annotations

import numpy as np

from treepo_ray.algo._checks import finite_1d
from treepo_ray.tree.tree import Tree

DEAD_CORRECT = "dead_correct"
DEAD_WRONG = "dead_wrong"
STALE = "stale"
INFORMATIVE = "informative"
REGIMES = (DEAD_CORRECT, DEAD_WRONG, STALE, INFORMATIVE)


def leaf_pass_rate(leaf_rewards) -> float:
    """CATPO's p-hat: the share of leaves with reward > 0. `leaf_rewards` holds the leaves only (non-empty)."""
    r = finite_1d("leaf_rewards", leaf_rewards)
    if r.size == 0:
        raise ValueError("leaf_rewards is empty; a tree has at least one leaf")
    return float(np.mean(r > 0))


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of x and y, 0 where undefined (fewer than two points or a constant series)."""
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    dx, dy = x - x.mean(), y - y.mean()
    den = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    if den <= 0 or not np.isfinite(den):
        return 0.0
    return float(np.clip(np.sum(dx * dy) / den, -1.0, 1.0))


def informativeness(leaf_rewards, node_logprob_sums, node_rewards) -> float:
    """CATPO eq. 5: F(T) = p (1 - p) (1 - rho^2), a value in [0, 0.25].

    Shapes: `leaf_rewards` is 1-D over the leaves only (non-empty; p = share with reward > 0, eq. 3);
    `node_logprob_sums` and `node_rewards` are 1-D over all nodes, the root (prompt) at index 0, holding each
    node's summed token log-prob under the current policy and its propagated reward. rho (eq. 4) is the
    Pearson correlation of the two over the non-root nodes (index 1 on), 0 where undefined (fewer than two
    non-root nodes or a constant series). The root's entries are ignored but must be finite.
    """
    p = leaf_pass_rate(leaf_rewards)
    lp = finite_1d("node_logprob_sums", node_logprob_sums)
    nr = finite_1d("node_rewards", node_rewards)
    if lp.shape != nr.shape:
        raise ValueError(f"node_logprob_sums has shape {lp.shape} but node_rewards has shape {nr.shape}")
    if lp.size == 0:
        raise ValueError("node_logprob_sums is empty; it must cover every node, the root at index 0")
    rho = _pearson(lp[1:], nr[1:])
    return p * (1.0 - p) * (1.0 - rho * rho)


def classify_tree(
    F: float, p: float, tau_low: float = 0.025, tau_high: float = 0.10, var_cut: float = 0.05
) -> str:
    """Regime of a tree per CATPO Table 1, returned as one of REGIMES.

    Rule implemented, in this order (v = p (1 - p)):
      1. F <= tau_low and v < var_cut: dead_correct if p > 0.5, else dead_wrong (near-unanimous leaves).
      2. F > tau_high: informative.
      3. otherwise stale. This covers Table 1's tau_low < F <= tau_high, and also the case the table leaves
         open, F <= tau_low with v >= var_cut: leaves disagree but rho^2 is close to 1, i.e. the policy's
         confidence already tracks the rewards (the paper's definition of a stale tree, section 1).
    """
    if not np.isfinite(F) or F < 0:
        raise ValueError(f"F = {F}; the informativeness score must be finite and >= 0")
    if not np.isfinite(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p = {p}; the leaf pass rate must lie in [0, 1]")
    if tau_low > tau_high:
        raise ValueError(f"tau_low = {tau_low} must not exceed tau_high = {tau_high}")
    if F <= tau_low and p * (1.0 - p) < var_cut:
        return DEAD_CORRECT if p > 0.5 else DEAD_WRONG
    if F > tau_high:
        return INFORMATIVE
    return STALE


def informativeness_weights(F) -> np.ndarray:
    """CATPO eq. 6: w(T) = F(T) / mean of F over the batch; all ones when that mean is 0. Empty -> empty."""
    f = finite_1d("F", F)
    if np.any(f < 0):
        raise ValueError(f"F[{int(np.flatnonzero(f < 0)[0])}] is negative; informativeness scores are >= 0")
    if f.size == 0:
        return f
    mean = f.mean()
    if mean == 0:
        return np.ones_like(f)
    return f / mean


def tree_informativeness(tree: Tree) -> tuple[float, float]:
    """F(T) and p of a scored Tree: its trajectories' rewards as leaves, every rewarded node's summed log-prob.

    Nodes without a reward (NaN: no trajectory below them) are left out of the correlation.
    """
    leaf_rewards = [tree.reward[n] for n in tree.trajectories]
    nodes = [0] + [n for n in range(1, len(tree)) if np.isfinite(tree.reward[n])]
    logprob_sums = [float(sum(tree.logprobs[n])) for n in nodes]
    node_rewards = [0.0] + [tree.reward[n] for n in nodes[1:]]
    return informativeness(leaf_rewards, logprob_sums, node_rewards), leaf_pass_rate(leaf_rewards)
