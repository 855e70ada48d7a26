"""Credit assignment of the pipeline (no Ray, no model): hand-computed advantages per algorithm."""

import math

import pytest

from treepo_ray.runtime.batch import AlgoConfig, build_samples, keep_tree, tree_metrics
from treepo_ray.runtime.pipeline import PromptStream
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
    samples = build_samples([chains([1, 0, 0, 1])], AlgoConfig(name="grpo"))
    # mean 0.5, population std 0.5 -> +-1 (up to eps = 1e-6).
    assert [round(s.advantages, 5) for s in samples] == [1.0, -1.0, -1.0, 1.0]
    assert samples[0].prompt_ids == [1, 2] and samples[0].response_ids == [5, 5, 5]
    assert all(s.old_logprobs is None for s in samples)  # recomputed by the learner


def test_treepo_subgroup_scores_then_token_weighted_whitening():
    samples = build_samples([two_level_tree([1, 0, 0, 0])], AlgoConfig(name="treepo"))
    # Scores (level 0 mean 0.25; level 1 means 0.5 and 0; level 2 singletons skipped):
    # a1 (0.75 + 0.5)/2 = 0.625, a2 (-0.25 - 0.5)/2 = -0.375, b1 = b2 = (-0.25 + 0)/2 = -0.125.
    # Equal lengths: mean 0, variance 0.140625, std 0.375.
    assert [round(s.advantages, 4) for s in samples] == [1.6667, -1.0, -0.3333, -0.3333]
    assert samples[0].response_ids == [10, 10, 11, 11]


def test_treepo_flat_uses_one_group_per_prompt():
    samples = build_samples([two_level_tree([1, 0, 0, 0])], AlgoConfig(name="treepo_flat"))
    # mean 0.25, std sqrt(0.1875) = 0.4330
    assert [s.advantages for s in samples] == pytest.approx([1.7321, -0.5774, -0.5774, -0.5774], abs=1e-3)


def test_treerpo_gives_each_segment_its_node_advantage_and_masks_uniform_siblings():
    samples = build_samples([two_level_tree([1, 0, 0, 0])], AlgoConfig(name="treerpo"))
    # {A, B}: rewards 0.5, 0 -> mu 0.25, A (0.25)/(0.1875) = 1.3333, B -1.3333.
    # {a1, a2}: 1, 0 -> mu 0.5 -> +-2.  {b1, b2}: both 0 -> range 0 < 0.1 -> masked (0).
    adv = [[round(a, 4) for a in s.advantages] for s in samples]
    assert adv == [[1.3333, 1.3333, 2.0, 2.0], [1.3333, 1.3333, -2.0, -2.0],
                   [-1.3333, -1.3333, 0.0, 0.0], [-1.3333, -1.3333, 0.0, 0.0]]


def test_tree_weights_scale_every_sample_of_a_tree():
    trees = [chains([1, 0]), chains([0, 1])]
    samples = build_samples(trees, AlgoConfig(name="grpo"), tree_weights=[0.5, 2.0])
    assert [s.weight for s in samples] == [0.5, 0.5, 2.0, 2.0]
    with pytest.raises(ValueError, match="2 tree weights for 1 trees"):
        build_samples(trees[:1], AlgoConfig(name="grpo"), tree_weights=[1.0, 1.0])


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
    assert m["rollout/reward"] == pytest.approx(2 / 6)
    assert m["rollout/accuracy"] == pytest.approx(2 / 6)
    assert m["tree/stop_eos"] == 4 and m["tree/depth_max"] == 2
    assert m["rollout/response_len"] == pytest.approx(22 / 6)


def test_unknown_algorithm_and_missing_reward_are_errors():
    with pytest.raises(ValueError, match="algo.name"):
        AlgoConfig(name="ppo")
    t = chains([1, 0])
    t.reward[t.trajectories[0]] = math.nan
    with pytest.raises(ValueError, match="trajectory 0 has no reward"):
        build_samples([t], AlgoConfig(name="grpo"))


def test_prompt_stream_is_reproducible_and_resumable():
    records = [{"id": str(i), "prompt_ids": [i + 1]} for i in range(5)]
    a = PromptStream(records, seed=3)
    first = a.take(7)  # crosses into the second epoch
    assert sorted(r["id"].split("#")[0] for r in first[:5]) == ["0", "1", "2", "3", "4"]
    assert [r["id"].split("#")[1] for r in first] == [str(i) for i in range(7)]
    rest = a.take(4)
    b = PromptStream(records, seed=3, position=7)  # resumed at the checkpoint's data position
    assert b.take(4) == rest
    assert PromptStream(records, seed=3).take(7) == first
    assert len({r["seed"] for r in first}) == 7
