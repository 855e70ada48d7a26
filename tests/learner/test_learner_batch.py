"""What the learner takes: TrainTree and TrainSample validation, scored trees with their credit becoming TrainTrees,
and the ranks' shares of a batch (no model)."""

import numpy as np
import pytest

from treepo_ray.job.config import AlgoConfig
from treepo_ray.learner import TrainSample, TrainTree, shard_trees, train_trees
from treepo_ray.learner.batch import as_trees, tree_tokens
from treepo_ray.tree import Tree
from learner_testlib import random_train_trees


def chains(rewards, length=3, token=5):
    """Sequential sampling as a tree: one chain of one segment per sample."""
    t = Tree(prompt_ids=[1, 2], query_id="s")
    for _ in rewards:
        t.trajectories.append(t.add_node(0, [token] * length, [-1.0] * length))
    t.set_trajectory_rewards(rewards)
    return t


def test_trees_carry_advantages_weights_and_the_engines_logprobs():
    trees = [chains([1, 0, 0, 1]), chains([0, 1], length=2, token=6)]
    out = train_trees(trees, AlgoConfig(name="grpo").credit(trees), tree_weights=[0.5, 2.0])
    assert [round(a, 5) for a in out[0].advantages] == [1.0, -1.0, -1.0, 1.0]
    assert out[0].prompt_ids == [1, 2] and out[0].tokens[1] == [5, 5, 5] and out[1].tokens[2] == [6, 6]
    assert out[0].logprobs[1] == [-1.0] * 3  # behaviour log-probs travel with the tree
    assert [t.weight for t in out] == [0.5, 2.0] and out[0].node_advantages is None
    with pytest.raises(ValueError, match="1 trees but 1 credits and 2 weights"):
        train_trees(trees[:1], AlgoConfig(name="grpo").credit(trees[:1]), tree_weights=[1.0, 1.0])


def test_per_node_credit_and_nodes_off_every_trajectory_dropped():
    t = Tree(prompt_ids=[1])
    a = t.add_node(0, [2], [-0.5])
    b = t.add_node(0, [3], [-0.5])
    t.add_node(a, [4], [-0.1])  # never on a trajectory: dropped
    t.trajectories = [a, b]
    t.set_trajectory_rewards([1.0, 0.0])
    (out,) = train_trees([t], AlgoConfig(name="treerpo").credit([t]))
    assert out.parent == [-1, 0, 0] and out.tokens == [[], [2], [3]] and out.trajectories == [1, 2]
    assert out.node_mask == [False, True, True]
    assert out.node_advantages[1] == pytest.approx(0.5 / (0.25 + 1e-6)) and out.node_advantages[0] == 0.0


def test_a_sample_is_a_one_segment_tree():
    tree = TrainSample([5, 6], [7, 8], advantages=[1.0, -1.0], weight=0.5, old_logprobs=[-1.0, -2.0]).as_tree()
    assert tree.parent == [-1, 0] and tree.tokens == [[], [7, 8]] and tree.logprobs == [[], [-1.0, -2.0]]
    assert tree.advantages == [[1.0, -1.0]] and tree.weight == 0.5


@pytest.mark.parametrize(
    "sample, message",
    [
        (TrainSample([], [1], 1.0), r"batch\[0\]\.prompt_ids is empty"),
        (TrainSample([1], [], 1.0), r"batch\[0\]\.response_ids is empty"),
        (TrainSample([1], [2, 999], 1.0), r"batch\[0\]\.response_ids\[1\] = 999 is outside the vocabulary"),
        (TrainSample([-1], [2], 1.0), r"batch\[0\]\.prompt_ids\[0\] = -1"),
        (TrainSample([1], [2, 3], [1.0]), r"batch\[0\]\.advantages has 1 values for 2"),
        (TrainSample([1], [2], "high"), r"batch\[0\]\.advantages = 'high'"),
        (TrainSample([1], [2], 1.0, old_logprobs=[0.0, 0.0]), r"batch\[0\]\.old_logprobs has 2 values for 1"),
        (TrainTree([1], [-1, 0, 0], [[], [2], [3]], [1, 2], [1.0]), r"advantages has 1 entries for 2"),
        (TrainTree([1], [-1, 1], [[], [2]], [1], [1.0]), r"parent\[1\] = 1"),
        (TrainTree([1], [-1, 0], [[], []], [1], [1.0]), r"tokens\[1\] is empty"),
        (TrainTree([1], [-1, 0], [[], [2]], [1], [1.0], logprobs=[[], []]), r"logprobs\[1\] has 0 values"),
        (TrainTree([1], [-1, 0], [[], [2]], [1], [1.0], node_advantages=[0, 1]), r"come together"),
        ("tree", r"batch\[0\] is a str"),
    ],
)
def test_bad_items_are_named(sample, message):
    with pytest.raises(ValueError, match=message):
        as_trees([sample], "batch", vocab_size=100)


def test_shards_partition_the_batch_by_tokens():
    trees = random_train_trees(np.random.default_rng(0), "treepo", n=7)
    shares = [shard_trees(trees, r, 3) for r in range(3)]
    assert sorted(id(t) for s in shares for t in s) == sorted(id(t) for t in trees)
    loads = [sum(tree_tokens(t) for t in s) for s in shares]
    assert max(loads) - min(loads) <= max(tree_tokens(t) for t in trees)
    assert shard_trees(trees, 0, 1) == trees
