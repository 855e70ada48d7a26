"""Credit assignment over a batch of scored trees (each algorithm's file, algo/credit.py): hand-computed advantages per algorithm, DAPO's
filter and the batch statistics (no Ray, no model)."""

import math

import pytest

from treepo_ray.algo.credit import advantage_metrics, keep_tree, tree_metrics
from treepo_ray.algo import AlgoConfig
from treepo_ray.algo.grpo import GRPOCreditConfig
from treepo_ray.algo.treepo import TreePOCreditConfig
from treepo_ray.algo.treerpo import TreeRPOCreditConfig
from treepo_ray.tree import Tree


def two_level_tree(rewards, seg_len=2):
    """root -> A(1), B(2); A -> a1(3), a2(4); B -> b1(5), b2(6); every segment `seg_len` tokens."""
    t = Tree(prompt_ids=[7, 8, 9], query_id="q")
    for parent in (0, 0, 1, 1, 2, 2):
        t.add_node(parent, [parent + 10] * seg_len, [-0.5] * seg_len)
    t.trajectories = [3, 4, 5, 6]
    t.set_trajectory_rewards(rewards)
    return t


def chains(rewards, length=3):
    """Sequential sampling as a tree: one chain of one segment per sample."""
    t = Tree(prompt_ids=[1, 2], query_id="s")
    for _ in rewards:
        t.trajectories.append(t.add_node(0, [5] * length, [-1.0] * length))
    t.set_trajectory_rewards(rewards)
    return t


def test_grpo_advantage_is_group_normalised():
    (adv,) = AlgoConfig(name="grpo").advantages([chains([1, 0, 0, 1])])
    # mean 0.5, population std 0.5 -> +-1 (up to eps = 1e-6).
    assert [round(a, 5) for a in adv] == [1.0, -1.0, -1.0, 1.0]
    # Without the scale (Dr. GRPO): only the mean is subtracted.
    assert AlgoConfig(name="grpo", grpo=GRPOCreditConfig(scale=False)).advantages([chains([1, 0, 0, 1])]) == [[0.5, -0.5, -0.5, 0.5]]


def test_treepo_subgroup_scores_then_token_weighted_whitening():
    (adv,) = AlgoConfig(name="treepo").advantages([two_level_tree([1, 0, 0, 0])])
    # Scores (level 0 mean 0.25; level 1 means 0.5 and 0; level 2 singletons skipped):
    # a1 (0.75 + 0.5)/2 = 0.625, a2 (-0.25 - 0.5)/2 = -0.375, b1 = b2 = (-0.25 + 0)/2 = -0.125.
    # Equal lengths: mean 0, variance 0.140625, std 0.375.
    assert [round(a, 4) for a in adv] == [1.6667, -1.0, -0.3333, -0.3333]


def test_treepo_whitening_spans_the_batch_and_weighs_tokens():
    short, uniform = chains([1, 0], length=1), chains([0, 0], length=3)
    # Scores +-0.5 and 0, 0: the uniform tree adds nothing to the mean but counts in the batch's std. By tokens
    # (weights 1, 1, 3, 3) the variance is 0.5 / 8, std 0.25; one weight per trajectory: 0.5 / 4, std sqrt(1/8).
    by_tokens = AlgoConfig(name="treepo").advantages([short, uniform])
    per_trajectory = AlgoConfig(name="treepo", treepo=TreePOCreditConfig(whiten_by_tokens=False)).advantages([short, uniform])
    assert by_tokens == [pytest.approx([2.0, -2.0], abs=1e-4), pytest.approx([0.0, 0.0], abs=1e-6)]
    assert per_trajectory == [pytest.approx([math.sqrt(2), -math.sqrt(2)], abs=1e-4),
                              pytest.approx([0.0, 0.0], abs=1e-6)]
    assert AlgoConfig(name="treepo").advantages([]) == []


def test_treepo_flat_uses_one_group_per_prompt():
    (adv,) = AlgoConfig(name="treepo_flat").advantages([two_level_tree([1, 0, 0, 0])])
    # mean 0.25, std sqrt(0.1875) = 0.4330
    assert adv == pytest.approx([1.7321, -0.5774, -0.5774, -0.5774], abs=1e-3)


def test_treerpo_gives_each_segment_its_node_advantage_and_masks_uniform_siblings():
    (adv,) = AlgoConfig(name="treerpo").advantages([two_level_tree([1, 0, 0, 0])])
    # {A, B}: rewards 0.5, 0 -> mu 0.25, A (0.25)/(0.1875) = 1.3333, B -1.3333.
    # {a1, a2}: 1, 0 -> mu 0.5 -> +-2.  {b1, b2}: both 0 -> range 0 < 0.1 -> masked (0).
    assert [[round(a, 4) for a in per_token] for per_token in adv] == [
        [1.3333, 1.3333, 2.0, 2.0], [1.3333, 1.3333, -2.0, -2.0],
        [-1.3333, -1.3333, 0.0, 0.0], [-1.3333, -1.3333, 0.0, 0.0]]
    # CATPO's credit is TreeRPO's (its tree weights are applied by the caller).
    assert AlgoConfig(name="catpo").advantages([two_level_tree([1, 0, 0, 0])]) == [adv]
    # A prune range above the root's children's spread (0.5) masks them too.
    (pruned,) = AlgoConfig(name="treerpo", treerpo=TreeRPOCreditConfig(prune_range=0.6)).advantages([two_level_tree([1, 0, 0, 0])])
    assert [round(a, 4) for a in pruned[0]] == [0.0, 0.0, 2.0, 2.0]


def test_dapo_filter_drops_uniform_groups():
    assert keep_tree(chains([1, 0, 1]))
    assert not keep_tree(chains([1, 1, 1]))
    assert not keep_tree(chains([0, 0]))


def test_tree_metrics_shared_prefix_share_and_stops():
    t = two_level_tree([1, 0, 0, 0])
    t.meta["growth"] = {"branches": 3, "fallbacks": 1, "finish/eos": 4}
    m = tree_metrics([t, chains([1, 0])])
    # Tree: 4 paths of 4 tokens = 16, distinct path nodes 6 x 2 = 12; chains: 6 and 6 -> 1 - 18/22.
    assert m["tree/shared_prefix_share"] == pytest.approx(1 - 18 / 22)
    assert m["critic/score/mean"] == pytest.approx(2 / 6)
    assert m["rollout/accuracy"] == pytest.approx(2 / 6)
    assert m["tree/depth_max"] == 2 and not any(k.startswith("tree/stop_") for k in m)
    assert m["response_length/mean"] == pytest.approx(22 / 6)
    # growth counters are this batch's totals (a tree without growth statistics counts nothing)
    assert m["growth/stop_eos"] == 4 and m["growth/branches"] == 3 and m["growth/fallbacks"] == 1
    assert m["growth/budget_transfers"] == 0 and m["growth/stop_boxed"] == 0
    assert tree_metrics([]) == {}


def test_verl_figures_score_range_length_clip_ratio_and_token_advantages():
    t, c = two_level_tree([1, 0, 0, 0]), chains([1, 0], length=3)  # responses of 4, 4, 4, 4 and 3, 3 tokens
    m = tree_metrics([t, c], response_limit=4)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, 0.0)
    assert (m["response_length/max"], m["response_length/min"]) == (4.0, 3.0)
    assert m["response_length/clip_ratio"] == pytest.approx(4 / 6)  # those that reached the limit
    assert "response_length/clip_ratio" not in tree_metrics([t])  # no limit given, no ratio
    # verl's critic/advantages/*: over response tokens, so a scalar advantage counts once per token.
    m = advantage_metrics([t, c], [[1.0, 0.0, 0.0, 0.0], [0.5, -0.5]])
    assert m["critic/advantages/mean"] == pytest.approx((4 * 1.0 + 3 * 0.5 - 3 * 0.5) / 22)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (1.0, -0.5)
    # per-token advantages as given, and CATPO's tree weights applied
    m = advantage_metrics([c], [[[1.0, 2.0, 3.0], [0.0, 0.0, -3.0]]], weights=[2.0])
    assert m == {"critic/advantages/mean": pytest.approx(2 * 3 / 6), "critic/advantages/max": 6.0,
                 "critic/advantages/min": -6.0}


def test_unknown_algorithm_and_missing_reward_are_errors():
    with pytest.raises(ValueError, match="algo.name = 'ppo'"):
        AlgoConfig(name="ppo").advantages([chains([1, 0])])
    t = chains([1, 0])
    t.reward[t.trajectories[0]] = math.nan
    with pytest.raises(ValueError, match="trajectory 0 has no reward"):
        AlgoConfig(name="grpo").advantages([t])
