"""CATPO's plain parts (algo/catpo.py): phase 2 scoring, phase 4 weights reaching the samples, the heal bookkeeping and
the step metrics, on constructed trees with hand-computed F(T) (no Ray, no model)."""

import math

import pytest

from treepo_ray.algo.catpo import catpo_metrics, catpo_weights, needs_healing, record_heal, score_tree
from treepo_ray.algo.credit import sampled_tokens
from treepo_ray.healing.critique import HealResult
from treepo_ray.job.config import AlgoConfig
from treepo_ray.learner.batch import train_trees
from treepo_ray.tree.tree import Tree

PAPER = dict(tau_low=0.025, tau_high=0.10, var_cut=0.05)  # CATPO Table 1 (the job's defaults: algo.catpo)


def flat_tree(rewards, logprobs, qid):
    """Root with one single-token child per leaf; child i's log-prob (its summed log-prob) is logprobs[i]."""
    t = Tree(prompt_ids=[5, 6], query_id=qid)
    for lp in logprobs:
        t.add_node(0, [10], [lp], "eos")
    t.trajectories = t.leaves()
    t.set_trajectory_rewards(rewards)
    return t


def batch():
    # informative: p = 1/4, equal log-probs (rho undefined -> 0): F = 3/16 = 0.1875 > 0.10
    informative = flat_tree([1, 0, 0, 0], [-1.0] * 4, "inf")
    # stale: p = 1/4, log-prob sums x = (2, 0, 0, 1) vs rewards (1, 0, 0, 0): rho^2 = 1.5625 / (2.75 * 0.75),
    # F = 0.1875 * (1 - rho^2) = 0.04545..., between tau_low and tau_high
    stale = flat_tree([1, 0, 0, 0], [2.0, 0.0, 0.0, 1.0], "stale")
    dead_wrong = flat_tree([0, 0, 0, 0], [-1.0, -2.0, -3.0, -4.0], "wrong")  # p = 0: F = 0
    dead_correct = flat_tree([1, 1, 1, 1], [-1.0, -2.0, -3.0, -4.0], "right")  # p = 1: F = 0
    return [informative, stale, dead_wrong, dead_correct]


F_STALE = 0.1875 * (1 - 1.5625 / (2.75 * 0.75))


def test_phase2_scores_and_classifies_each_tree():
    trees = batch()
    got = [score_tree(t, **PAPER) for t in trees]
    assert [g["regime"] for g in got] == ["informative", "stale", "dead_wrong", "dead_correct"]
    assert [g["F"] for g in got] == pytest.approx([0.1875, F_STALE, 0.0, 0.0])
    assert [g["p"] for g in got] == [0.25, 0.25, 0.0, 1.0]
    assert all(t.meta["catpo"]["F0"] == t.meta["catpo"]["F"] for t in trees)  # nothing healed yet
    assert [needs_healing(t) for t in trees] == [False, False, True, False]  # only dead-wrong trees are healed
    # With tau_high above 0.1875 the informative tree is stale.
    assert score_tree(batch()[0], **{**PAPER, "tau_high": 0.2})["regime"] == "stale"


def test_phase4_weights_are_F_over_the_batch_mean_and_reach_the_samples():
    trees = batch()
    mean = (0.1875 + F_STALE) / 4
    w = catpo_weights(trees)
    assert w == pytest.approx([0.1875 / mean, F_STALE / mean, 0.0, 0.0])
    assert sum(w) / len(w) == pytest.approx(1.0)  # normalised: the batch's mean weight is 1
    assert catpo_weights([trees[2], trees[3]]) == [1.0, 1.0]  # all F = 0: uniform, not 0/0

    # What the batch builder does with them (runtime/batches.py: BatchBuilder.credit).
    weighted = train_trees(trees, AlgoConfig(name="catpo").credit(trees), w)
    plain = train_trees(trees, AlgoConfig(name="treerpo").credit(trees))
    assert [t.node_advantages for t in weighted] == [t.node_advantages for t in plain]  # TreeRPO's credit ...
    assert [t.node_mask for t in weighted] == [t.node_mask for t in plain]
    assert [t.weight for t in weighted] == pytest.approx(w)
    # ... e.g. the informative tree's winner: (1 - 1/4) / (1/4 * 3/4 + eps) with eps = 1e-6 (TreeRPO eq. 2)
    assert weighted[0].node_advantages[1] == pytest.approx(0.75 / (0.1875 + 1e-6))
    assert weighted[0].advantages[0] == [weighted[0].node_advantages[1]]  # per token of each trajectory too


def test_step_metrics_count_regimes_healing_and_cost():
    trees = batch()
    for t in trees:
        score_tree(t, **PAPER)
    wrong = trees[2]
    # What a heal does to the tree (grafts 2 children of the root, one verified correct), then the rescore.
    g1 = wrong.add_node(0, [11, 12, 13], [-0.5] * 3, "eos")
    g2 = wrong.add_node(0, [14], [-0.5], "eos")
    wrong.trajectories += [g1, g2]
    wrong.meta["grafted"] = [g1, g2]
    wrong.reward[g1], wrong.reward[g2] = 1.0, 0.0
    wrong.propagate_rewards()
    record_heal(wrong, HealResult(failure_node=0, grafted=[g1, g2], critique="c", prompt_tokens=30,
                                  generated_tokens=9, rewards=[1.0, 0.0]))
    healed = score_tree(wrong, **PAPER)
    assert healed["regime0"] == "dead_wrong" and healed["p"] == pytest.approx(1 / 6) and healed["F"] > 0
    record_heal(trees[3], None, error="refused")  # a failed attempt counts as an attempt, not a heal

    w = catpo_weights(trees)
    m = catpo_metrics(trees, w)
    assert (m["catpo/informative"], m["catpo/stale"], m["catpo/dead_wrong"], m["catpo/dead_correct"]) == (1, 1, 1, 1)
    assert m["catpo/F_mean_sampled"] == pytest.approx((0.1875 + F_STALE) / 4)
    assert m["catpo/F_mean"] == pytest.approx((0.1875 + F_STALE + healed["F"]) / 4)
    assert (m["catpo/heal_attempts"], m["catpo/heal_errors"], m["catpo/healed"], m["catpo/healed_share"]) == (
        2, 1, 1, 0.5)
    assert (m["catpo/heal_generated_tokens"], m["catpo/heal_prompt_tokens"], m["catpo/grafted"]) == (9, 30, 2)
    assert m["catpo/heal_F_improved"] == 1
    assert m["catpo/weight_zero_share"] == 0.25 and m["catpo/weight_max"] == pytest.approx(max(w))
    # Sampled tokens: 16 sampled one-token segments, plus the healing's 9 generated tokens (grafts not twice).
    assert sampled_tokens(trees) == 16 + 9


def test_unscored_trees_are_refused_and_no_heal_gives_no_healed_share():
    with pytest.raises(ValueError, match="'inf' was never scored"):
        catpo_metrics(batch())
    assert math.isnan(catpo_metrics([t for t in batch() if score_tree(t, **PAPER)])["catpo/healed_share"])
