import math

import pytest

from treepo_ray.tree.tree import Tree


def small_tree() -> Tree:
    #        0 (prompt)
    #      1         2
    #    3   4       5
    t = Tree(prompt_ids=[7, 8], query_id="q")
    a = t.add_node(0, [1, 2], [-0.1, -0.2])
    b = t.add_node(0, [3], [-0.3])
    t.add_node(a, [4], [-0.4], "eos")
    t.add_node(a, [5, 6], [-0.5, -0.6], "boxed")
    t.add_node(b, [9], [-0.9], "max_depth")
    t.trajectories = [3, 4, 5]
    return t


def test_renumber_keeps_the_tree_and_refuses_an_order_with_a_child_before_its_parent():
    t = small_tree()
    t.set_trajectory_rewards([1.0, 0.0, 1.0])
    paths = [(t.response_ids(n), t.reward[n]) for n in t.trajectories]
    assert t.renumber([0, 2, 5, 1, 4, 3]) == [0, 3, 1, 5, 4, 2]  # the new id of each old node
    assert t.parent == [-1, 0, 1, 0, 3, 3] and t.tokens[2] == [9] and t.trajectories == [5, 4, 2]
    assert [(t.response_ids(n), t.reward[n]) for n in t.trajectories] == paths and t.depth == [0, 1, 2, 1, 2, 2]
    with pytest.raises(ValueError, match="parent before"):
        t.renumber([0, 2, 1, 3, 4, 5])
    with pytest.raises(ValueError, match="every node once"):
        t.renumber([0, 1, 1, 3, 4, 5])


def test_paths_and_prefixes():
    t = small_tree()
    assert t.leaves() == [3, 4, 5]
    assert t.children(1) == [3, 4]
    assert t.path(4) == [1, 4]
    assert t.response_ids(4) == [1, 2, 5, 6]
    assert t.response_logprobs(5) == [-0.3, -0.9]
    assert t.prefix_ids(1) == [7, 8, 1, 2]
    assert t.depth == [0, 1, 1, 2, 2, 2]
    assert t.unique_tokens() == 2 + 7


def test_rewards_propagate_as_means():
    t = small_tree()
    t.set_trajectory_rewards([1.0, 0.0, 1.0])
    assert t.reward[1:] == [0.5, 1.0, 1.0, 0.0, 1.0]
    assert t.reward[0] == pytest.approx(0.75)


def test_trajectory_ending_at_inner_node_keeps_its_reward():
    t = small_tree()
    t.trajectories = [1, 3]  # node 1 ends a trajectory although it has children
    t.set_trajectory_rewards([0.2, 1.0])
    assert t.reward[1] == 0.2 and t.reward[3] == 1.0 and math.isnan(t.reward[4])


def test_json_round_trip():
    t = small_tree()
    t.set_trajectory_rewards([1.0, 0.0, 1.0])
    t.meta["ground_truth"] = "42"
    back = Tree.from_json(t.to_json())
    assert back == t


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: t.add_node(9, [1], [0.0]), "not a node"),
        (lambda t: t.add_node(0, [1, 2], [0.0]), "log-probs"),
        (lambda t: t.add_node(0, [1], [0.0], "done"), "finish reason"),
        (lambda t: t.set_trajectory_rewards([1.0]), "3 trajectories"),
        (lambda t: t.set_trajectory_rewards([1.0, math.nan, 0.0]), "not finite"),
    ],
)
def test_bad_input_is_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call(small_tree())


def test_keep_trajectories_leaves_the_others_out_as_if_never_sampled():
    t = small_tree()
    kept = t.keep_trajectories([0, 2])  # trajectory 1 (node 4) could not be verified
    assert kept.trajectories == [3, 4] and kept.parent == [-1, 0, 0, 1, 2]
    assert [kept.response_ids(n) for n in kept.trajectories] == [[1, 2, 4], [3, 9]]
    assert kept.leaves() == kept.trajectories and t.trajectories == [3, 4, 5]  # the original is untouched
    kept.set_trajectory_rewards([1.0, 0.0])
    assert kept.reward[0] == 0.5
    assert t.keep_trajectories([]).parent == [-1] and t.keep_trajectories([]).trajectories == []
