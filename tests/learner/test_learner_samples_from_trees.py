"""Scored trees with their advantages become training samples (learner/batch.py: samples_from_trees; no model)."""

import pytest

from treepo_ray.job.config import AlgoConfig
from treepo_ray.learner.batch import samples_from_trees
from treepo_ray.tree import Tree


def chains(rewards, length=3, token=5):
    """Sequential sampling as a tree: one chain of one segment per sample."""
    t = Tree(prompt_ids=[1, 2], query_id="s")
    for _ in rewards:
        t.trajectories.append(t.add_node(0, [token] * length, [-1.0] * length))
    t.set_trajectory_rewards(rewards)
    return t


def test_one_sample_per_trajectory_with_its_advantage_and_no_old_logprobs():
    trees = [chains([1, 0, 0, 1]), chains([0, 1], length=2, token=6)]
    samples = samples_from_trees(trees, AlgoConfig(name="grpo").advantages(trees))
    assert [round(s.advantages, 5) for s in samples] == [1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    assert samples[0].prompt_ids == [1, 2] and samples[0].response_ids == [5, 5, 5]
    assert samples[4].response_ids == [6, 6]
    assert all(s.old_logprobs is None for s in samples)  # recomputed by the learner
    assert all(s.weight == 1.0 for s in samples)


def test_tree_weights_scale_every_sample_of_a_tree():
    trees = [chains([1, 0]), chains([0, 1])]
    samples = samples_from_trees(trees, AlgoConfig(name="grpo").advantages(trees), tree_weights=[0.5, 2.0])
    assert [s.weight for s in samples] == [0.5, 0.5, 2.0, 2.0]
    with pytest.raises(ValueError, match="1 trees but 1 advantage lists and 2 weights"):
        samples_from_trees(trees[:1], AlgoConfig(name="grpo").advantages(trees[:1]), tree_weights=[1.0, 1.0])
