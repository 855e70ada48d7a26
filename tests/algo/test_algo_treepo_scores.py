"""TreePO subgroup scores: the paper's worked example on a concrete tree, edge cases, and a brute-force reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepo_ray.algo import grpo_advantages, treepo_scores

# The TreePO worked example (section 2.3): a correct trajectory whose subgroups at depths 1, 2, 3 average 0.6,
# 0.8 and 1.0. Trajectory 0 walks nodes 1 -> 2 -> 3 -> 4; the whole group (16 trajectories) averages 0.5.
EXAMPLE = [
    ([1, 2, 3, 4], 1.0),  # trajectory 0, the one of the example
    ([1, 2, 3, 5], 1.0),  # shares 1, 2, 3: depth-3 subgroup {0, 1}, mean 1.0
    ([1, 2, 6], 1.0),
    ([1, 2, 7], 1.0),
    ([1, 2, 8], 0.0),  # depth-2 subgroup {0..4}: 4 of 5 correct, mean 0.8
    ([1, 9, 10], 1.0),
    ([1, 9, 11], 1.0),
    ([1, 9, 12], 0.0),
    ([1, 13], 0.0),
    ([1, 14], 0.0),  # depth-1 subgroup {0..9}: 6 of 10 correct, mean 0.6
    ([15, 16], 1.0),
    ([15, 17], 1.0),
    ([15, 18], 0.0),
    ([19, 20], 0.0),
    ([19, 21], 0.0),
    ([19, 22], 0.0),  # whole group: 8 of 16 correct, mean 0.5
]
PATHS = [p for p, _ in EXAMPLE]
REWARDS = np.array([r for _, r in EXAMPLE])


def test_worked_example_level_means():
    # The tree really has the level means of the paper's example (depth 4 is a singleton, so skipped).
    def mean_sharing(d):
        return np.mean([r for p, r in EXAMPLE if p[:d] == PATHS[0][:d]])

    assert [mean_sharing(d) for d in range(4)] == [0.5, 0.6, 0.8, 1.0]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, (0.5 + 0.4 + 0.2 + 0.0) / 4),
        ({"include_root": False}, (0.4 + 0.2 + 0.0) / 3),  # the paper's [+0.4, +0.2, 0.0] averaged
        ({"weighting": "size"}, (16 * 0.5 + 10 * 0.4 + 5 * 0.2 + 2 * 0.0) / (16 + 10 + 5 + 2)),
        ({"weighting": "size", "include_root": False}, (10 * 0.4 + 5 * 0.2) / (10 + 5 + 2)),
        ({"skip_uniform_subgroups": True}, (0.5 + 0.4 + 0.2) / 3),  # depth-3 subgroup is all correct
        ({"skip_uniform_subgroups": True, "include_root": False}, (0.4 + 0.2) / 2),
    ],
)
def test_worked_example_score(kwargs, expected):
    assert treepo_scores(PATHS, REWARDS, **kwargs)[0] == pytest.approx(expected)


def test_worked_example_other_trajectories():
    s = treepo_scores(PATHS, REWARDS)
    # trajectory 4 ([1, 2, 8], wrong): levels 0, 1, 2 -> -0.5, -0.6, -0.8 (depth 3 is a singleton)
    assert s[4] == pytest.approx((-0.5 - 0.6 - 0.8) / 3)
    # trajectory 8 ([1, 13], wrong): levels 0, 1 -> -0.5, -0.6
    assert s[8] == pytest.approx((-0.5 - 0.6) / 2)
    # trajectory 10 ([15, 16], right): level 0 -> 0.5, level 1 {10, 11, 12} mean 2/3 -> 1/3
    assert s[10] == pytest.approx((0.5 + 1 / 3) / 2)
    # include_root=False: trajectory 13's only level is {13, 14, 15}, all wrong -> 0
    assert treepo_scores(PATHS, REWARDS, include_root=False)[13] == 0.0


def test_edge_cases():
    assert treepo_scores([], []).shape == (0,)
    np.testing.assert_array_equal(treepo_scores([[1, 2]], [1.0]), [0.0])
    np.testing.assert_array_equal(treepo_scores([[1, 2]], [1.0], include_root=False), [0.0])
    np.testing.assert_array_equal(treepo_scores([[1, 2], [1, 3], [4]], [0.5, 0.5, 0.5]), [0.0, 0.0, 0.0])
    # empty paths: only level 0 applies
    np.testing.assert_allclose(treepo_scores([[], []], [1.0, 0.0]), [0.5, -0.5])
    np.testing.assert_array_equal(treepo_scores([[], []], [1.0, 0.0], include_root=False), [0.0, 0.0])
    # a path that is a prefix of another has no level at the other's extra depths
    np.testing.assert_allclose(treepo_scores([[1], [1, 2], [1, 2]], [0.0, 1.0, 0.0], include_root=False),
                               [-1 / 3, (2 / 3 + 0.5) / 2, (-1 / 3 - 0.5) / 2])


def test_one_level_equals_unscaled_grpo():
    rewards = [1.0, 0.0, 0.0, 0.5]
    paths = [[7], [7], [7], [7]]  # level 1 is the whole group again
    np.testing.assert_allclose(treepo_scores(paths, rewards, include_root=False),
                               grpo_advantages(rewards, scale=False))
    distinct = [[1], [2], [3], [4]]  # every level-1 subgroup is a singleton: nothing kept
    np.testing.assert_array_equal(treepo_scores(distinct, rewards, include_root=False), np.zeros(4))


def test_bad_input():
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        treepo_scores([[1], [2]], [0.0, float("nan")])
    with pytest.raises(ValueError, match=r"rewards\[0\]"):
        treepo_scores([[1], [2]], [float("inf"), 0.0])
    with pytest.raises(ValueError, match="2 trajectories but rewards has 3"):
        treepo_scores([[1], [2]], [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="weighting"):
        treepo_scores([[1], [2]], [0.0, 1.0], weighting="median")


def reference_scores(paths, rewards, weighting="average", include_root=True, skip_uniform_subgroups=False):
    """Brute force: for each trajectory and depth, list the members by comparing whole prefixes."""
    out = []
    for i, path in enumerate(paths):
        parts, sizes = [], []
        for d in range(0 if include_root else 1, len(path) + 1):
            members = [j for j in range(len(paths)) if list(paths[j][:d]) == list(path[:d])]
            group = [rewards[j] for j in members]
            if d > 0 and (len(group) < 2 or (skip_uniform_subgroups and len(set(group)) == 1)):
                continue
            parts.append(rewards[i] - sum(group) / len(group))
            sizes.append(len(group) if weighting == "size" else 1)
        out.append(sum(p * s for p, s in zip(parts, sizes)) / sum(sizes) if sizes else 0.0)
    return np.array(out)


@st.composite
def random_trees(draw, max_nodes=30, reward=st.sampled_from([0.0, 0.5, 1.0]) | st.floats(-2, 2)):
    """Root-to-leaf paths (root excluded) of a random tree, one trajectory per leaf, and their rewards."""
    n = draw(st.integers(2, max_nodes))
    parent = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    has_child = set(parent[1:])
    paths = []
    for leaf in (i for i in range(1, n) if i not in has_child):
        path, node = [], leaf
        while node != 0:
            path.append(node)
            node = parent[node]
        paths.append(path[::-1])
    rewards = draw(st.lists(reward, min_size=len(paths), max_size=len(paths)))
    return paths, np.array(rewards)


# Free-form paths: repeated node ids, duplicate paths, prefixes of one another, empty paths.
free_paths = st.lists(st.lists(st.integers(0, 2), max_size=4), min_size=1, max_size=12).flatmap(
    lambda ps: st.tuples(st.just(ps), st.lists(st.sampled_from([0.0, 1.0]), min_size=len(ps), max_size=len(ps)))
)
options = st.fixed_dictionaries({
    "weighting": st.sampled_from(["average", "size"]),
    "include_root": st.booleans(),
    "skip_uniform_subgroups": st.booleans(),
})


@settings(max_examples=120, deadline=None)
@given(random_trees() | free_paths, options)
def test_matches_brute_force_reference(tree, opts):
    paths, rewards = tree
    np.testing.assert_allclose(treepo_scores(paths, rewards, **opts),
                               reference_scores(paths, list(rewards), **opts), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.integers(1, 3), st.data(), st.sampled_from(["average", "size"]))
def test_full_tree_scores_sum_to_zero(branching, depth, data, weighting):
    # In a full N-ary tree every trajectory keeps the same levels with the same sizes, so each level's
    # deviations (which sum to 0 within a subgroup) enter every score with the same weight.
    paths = [[tuple(d[: k + 1]) for k in range(depth)] for d in np.ndindex(*(branching,) * depth)]
    rewards = np.array(data.draw(st.lists(st.floats(0, 1), min_size=len(paths), max_size=len(paths))))
    scores = treepo_scores(paths, rewards, weighting=weighting)
    assert abs(scores.sum()) < 1e-9


@settings(max_examples=60, deadline=None)
@given(random_trees(reward=st.integers(-4, 4).map(lambda k: k / 4)), st.floats(0.1, 5), st.floats(-3, 3), options)
def test_affine_in_rewards(tree, scale, shift, opts):
    paths, rewards = tree
    base = treepo_scores(paths, rewards, **opts)
    np.testing.assert_allclose(treepo_scores(paths, rewards * scale + shift, **opts), base * scale, atol=1e-9)
