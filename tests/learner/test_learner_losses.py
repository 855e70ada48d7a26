"""The learner's losses on trees, by hand: per-node TreeRPO/CATPO (CATPO eq. 7) with w(T) on the whole per-tree
term, masked nodes and zero-weight trees out of the denominator; and the decoupled-PPO behaviour weight. Log-probs
are given numbers (no model): packing.py's weights and algo/losses.py's tree_policy_loss."""

import math

import numpy as np
import pytest
import torch

from treepo_ray.algo.losses import LossConfig, tree_policy_loss
from treepo_ray.learner import TrainTree
from treepo_ray.learner.packing import TreeIndex, denominators, loss_weights, packed_micro_batch, plan

CPU = torch.device("cpu")


def node_tree(weight, node_adv, mask):
    """prompt [1, 2]; node 1 [3, 4], node 2 [5] under the root; nodes 3 [6, 7, 8] and 4 [9] under node 1."""
    return TrainTree([1, 2], [-1, 0, 0, 1, 1], [[], [3, 4], [5], [6, 7, 8], [9]], [3, 4, 2], [0.0, 0.0, 0.0],
                     node_advantages=node_adv, node_mask=mask, weight=weight)


def per_node_loss(trees, logp_of, old_of, ref_of, entropy_of, cfg, packing="tree"):
    """tree_policy_loss over the trees, with per-node given log-probs (`x_of[tree][node]`: one value per token)."""
    indices = [TreeIndex(t) for t in trees]
    denoms = denominators(indices)
    weights = [loss_weights(ix, cfg.aggregation, denoms) for ix in indices]
    total, sums = 0.0, {}
    for items in plan(indices, packing, 1000, 100):
        mb = packed_micro_batch(items, indices, weights, "gather", CPU) if packing == "tree" else None
        if mb is None:
            from treepo_ray.learner.packing import padded_micro_batch
            mb = padded_micro_batch(items, indices, weights, 0, CPU)

        def flat(values):
            return torch.from_numpy(mb.gather([[np.full(len(t), v[n]) for n, t in enumerate(ix.tree.tokens)]
                                               for ix, v in zip(indices, values)]))
        loss, figs = tree_policy_loss(flat(logp_of), flat(old_of), mb.weights, cfg, ref_logprobs=flat(ref_of),
                                      entropy=flat(entropy_of))
        total += loss.item()
        for k, v in figs.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return total, sums, denoms


@pytest.mark.parametrize("packing", ["tree", "none"])
def test_catpo_per_node_loss_by_hand(packing):
    # Tree A (w = 2): nodes 1, 2, 3 take part, node 4 is masked. Tree B (w = 0): out entirely. Tree C (w = 1):
    # node 1 only. Nodes taking part: 3 + 0 + 1 = 4 (the denominator).
    a = node_tree(2.0, [0.0, 0.5, -0.5, 1.0, -1.0], [False, True, True, True, False])
    b = node_tree(0.0, [0.0, 1.0, -1.0, 1.0, -1.0], [False, True, True, True, True])
    c = node_tree(1.0, [0.0, 2.0, 0.0, 0.0, 0.0], [False, True, False, False, False])
    logp = [[0.0, -1.0, -1.0, -1.0, -1.0]] * 3
    # Ratios: tree A's node 2 (A < 0) at 0.5 (clipped up to 1 - 0.2 = 0.8), node 3 (A > 0) at 1.5 (clipped to
    # 1 + 0.2 = 1.2); everything else 1.
    old = [[0.0, -1.0, -1.0 + math.log(2.0), -1.0 - math.log(1.5), -1.0], [0.0] + [-1.0] * 4, [0.0] + [-1.0] * 4]
    ref = [[0.0] + [-1.5] * 4] * 3  # k1 KL per token: logp - ref = 0.5
    ent = [[0.0] + [0.25] * 4] * 3
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="node-mean", kl_coef=0.1, kl_estimator="k1",
                     entropy_coef=0.01)
    loss, sums, denoms = per_node_loss([a, b, c], logp, old, ref, ent, cfg, packing)
    assert denoms[2] == 4
    # Each node once, the mean over its own tokens of -A * clipped ratio, times w(T), over 4 nodes:
    #   A: 2 * (0.5 * 1 + (-0.5) * 0.8 + 1.0 * 1.2) = 2.6;  C: 1 * (2.0 * 1) = 2.0
    pg = -(2.6 + 2.0) / 4
    # KL and entropy with w(T) too, each node's mean (0.5, 0.25) once: A has 3 nodes (w 2), C one (w 1).
    kl = (2 * 3 * 0.5 + 1 * 0.5) / 4
    entropy = (2 * 3 * 0.25 + 1 * 0.25) / 4
    assert sums["pg_loss"] == pytest.approx(pg)
    assert sums["kl_loss"] == pytest.approx(kl) and sums["entropy"] == pytest.approx(entropy)
    assert loss == pytest.approx(pg + 0.1 * kl - 0.01 * entropy)


def test_treerpo_per_node_loss_counts_a_shared_node_once():
    # TreeRPO (all w = 1): node 1 lies on two trajectories but enters once, with its own token mean. Advantages
    # 0.5 (node 1, 2 tokens), -1.0 (node 2, 1 token), 1.0 (node 3, 3 tokens), 2.0 (node 4, 1 token); all take part.
    t = node_tree(1.0, [0.0, 0.5, -1.0, 1.0, 2.0], [False, True, True, True, True])
    zero = [[0.0] * 5]
    loss, sums, denoms = per_node_loss([t], zero, zero, zero, zero, LossConfig(aggregation="node-mean"))
    assert denoms[2] == 4
    assert loss == pytest.approx(-(0.5 - 1.0 + 1.0 + 2.0) / 4)
    # A per-path token mean would instead weigh node 1 twice and every token alike:
    path_token_mean = -(2 * (0.5 * 2) + 1.0 * 3 + 2.0 * 1 - 1.0 * 1) / (5 + 3 + 1)
    assert loss != pytest.approx(path_token_mean)


def test_decoupled_behaviour_weight_scales_and_masks_tokens():
    # One token per case, A = 1 (token-mean over 1 token each): pg = -A * w_b * min(r, 1.28) per token.
    logp = torch.tensor([-1.0, -1.0, -1.0])
    prox = logp.clone()  # recompute on-policy: ratio 1
    behav = torch.tensor([-1.0, -1.0 - math.log(2.0), -1.0 - math.log(8.0)])  # weights 1, 2, 8
    weights = torch.zeros(3, 6, dtype=torch.float64)
    weights[:, 0] = 1.0 / 3  # pos = c * A, c = 1/3
    weights[:, 2] = 1.0 / 3
    iw = torch.exp(prox - behav)
    cap = 5.0
    masked = torch.where(iw > cap, torch.zeros_like(iw), iw)  # AReaL's token_mask: weight 8 dropped
    loss, _ = tree_policy_loss(logp, prox, weights, LossConfig(), behaviour_weight=masked)
    assert loss.item() == pytest.approx(-(1 + 2 + 0) / 3)
    loss, _ = tree_policy_loss(logp, prox, weights, LossConfig(), behaviour_weight=iw.clamp(max=cap))
    assert loss.item() == pytest.approx(-(1 + 2 + 5) / 3)  # token_truncate: capped at 5
