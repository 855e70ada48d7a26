import math

import pytest

from treepo_ray.tree import branch_metrics, branch_points
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


def test_branch_points_are_informative_when_their_children_end_differently():
    t = Tree(prompt_ids=[1, 2])
    a = t.add_node(0, [5, 6], [-1.0, -1.0], entropy=[2.0, 0.5])
    b = t.add_node(0, [7], [-1.0], entropy=[2.0])
    a1 = t.add_node(a, [8], [-1.0], entropy=[1.0])
    a2 = t.add_node(a, [9, 9], [-1.0, -1.0], entropy=[1.0, 0.25])
    b1 = t.add_node(b, [3], [-1.0], entropy=[0.5])
    b2 = t.add_node(b, [4], [-1.0], entropy=[0.5])
    t.trajectories = [a1, a2, b1, b2]
    t.set_trajectory_rewards([1.0, 0.0, 0.0, 0.0])  # a: 0.5, b: 0.0
    assert branch_points(t) == [(0, [a, b], True), (a, [a1, a2], True), (b, [b1, b2], False)]
    m = branch_metrics([t])
    assert m["tree/branch_points"] == 3 and m["tree/informative_branches"] == pytest.approx(2 / 3)
    assert m["tree/informative_branches_depth0"] == 1 and m["tree/informative_branches_depth1"] == 0.5
    assert m["tree/tokens_per_informative_branch"] == 8 / 2
    assert m["tree/branch_entropy"] == pytest.approx((2.0 + 1.0 + 0.5) / 3)
    assert m["tree/token_entropy"] == pytest.approx((2.0 + 0.5 + 2.0 + 1.0 + 1.0 + 0.25 + 0.5 + 0.5) / 8)
    flat = Tree(prompt_ids=[1])  # no entropies reported, one child with a reward: no branch point
    flat.trajectories = [flat.add_node(0, [4], [-1.0])]
    flat.set_trajectory_rewards([1.0])
    m = branch_metrics([flat])
    assert m["tree/branch_points"] == 0 and math.isnan(m["tree/informative_branches"])
    assert math.isnan(m["tree/branch_entropy"])
    assert Tree.from_dict(t.to_dict()).entropy == t.entropy
