"""TreeRPO reward propagation and sibling advantages: a hand-computed tree, edge cases, random-tree properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepo_ray.algo import leaf_mask, propagate_rewards, treerpo_advantages

NAN = float("nan")
# root 0 -> 1, 2, 3;  1 -> 4, 5;  2 -> 6, 7;  3 is a leaf
PARENT = np.array([-1, 0, 0, 0, 1, 1, 2, 2])
LEAF_REWARDS = np.array([NAN, NAN, NAN, 0.0, 1.0, 0.0, 1.0, 1.0])


def test_leaf_mask():
    np.testing.assert_array_equal(leaf_mask(PARENT), [0, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(leaf_mask([-1]), [True])


def test_propagate_by_hand():
    r = propagate_rewards(PARENT, LEAF_REWARDS)
    # node 1 = mean(1, 0), node 2 = mean(1, 1), node 3 keeps 0, root = mean(0.5, 1, 0)
    np.testing.assert_allclose(r, [0.5, 0.5, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])


def test_propagate_mean_of_children_not_of_leaves():
    # root -> 1, 2; 1 -> 3, 4, 5 (rewards 1, 1, 1); 2 is a leaf with 0. Mean of children: 0.5, of leaves: 0.75.
    r = propagate_rewards([-1, 0, 0, 1, 1, 1], [NAN, NAN, 0.0, 1.0, 1.0, 1.0])
    assert r[0] == pytest.approx(0.5)


def test_treerpo_by_hand():
    eps = 1e-6
    adv, mask = treerpo_advantages(PARENT, propagate_rewards(PARENT, LEAF_REWARDS), eps=eps)
    d = 0.25 + eps  # mu (1 - mu) with mu = 0.5
    # siblings {1, 2, 3}: rewards 0.5, 1, 0, mu 0.5; {4, 5}: 1, 0, mu 0.5; {6, 7}: 1, 1, mu 1 -> 0
    np.testing.assert_allclose(adv, [0.0, 0.0, 0.5 / d, -0.5 / d, 0.5 / d, -0.5 / d, 0.0, 0.0])
    np.testing.assert_array_equal(mask, [False, True, True, True, True, True, False, False])


def test_treerpo_non_binary_mu_and_prune_range():
    # root -> 1, 2, 3 with rewards 0.2, 0.2, 0.3: mu = 0.7 / 3, range 0.1 (not > 0.1, so pruned)
    r = np.array([0.7 / 3, 0.2, 0.2, 0.3])
    adv, mask = treerpo_advantages([-1, 0, 0, 0], r, eps=0.0)
    mu = 0.7 / 3
    np.testing.assert_allclose(adv[1:], (r[1:] - mu) / (mu * (1 - mu)))
    assert not mask.any()
    _, mask = treerpo_advantages([-1, 0, 0, 0], r, prune_range=0.05)
    np.testing.assert_array_equal(mask, [False, True, True, True])


def test_single_root_and_only_child():
    adv, mask = treerpo_advantages([-1], [1.0])
    assert adv.tolist() == [0.0] and mask.tolist() == [False]
    np.testing.assert_array_equal(propagate_rewards([-1], [0.25]), [0.25])
    adv, mask = treerpo_advantages([-1, 0, 1], [1.0, 1.0, 1.0])  # a chain: every node an only child
    assert adv.tolist() == [0.0, 0.0, 0.0] and not mask.any()


def test_bad_trees_and_rewards():
    with pytest.raises(ValueError, match="non-empty"):
        propagate_rewards([], [])
    with pytest.raises(ValueError, match=r"parent\[0\] must be -1"):
        propagate_rewards([0, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"parent\[2\] = 2"):
        treerpo_advantages([-1, 0, 2], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="integers"):
        propagate_rewards([-1.0, 0.0], [NAN, 1.0])
    with pytest.raises(ValueError, match=r"leaf_rewards\[4\] is nan at leaf node 4"):
        propagate_rewards(PARENT, [NAN, NAN, NAN, 0.0, NAN, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"leaf_rewards\[3\] is inf"):
        propagate_rewards(PARENT, [NAN, NAN, NAN, np.inf, 1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="8 nodes"):
        propagate_rewards(PARENT, [1.0, 0.0])
    with pytest.raises(ValueError, match=r"node_rewards\[2\] is nan"):
        treerpo_advantages([-1, 0, 0], [0.5, 1.0, NAN])
    with pytest.raises(ValueError, match=r"node_rewards\[1\] = 2.0.*\[0, 1\]"):
        treerpo_advantages([-1, 0, 0], [1.0, 2.0, 0.0])


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parent = np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    leaves = leaf_mask(parent)
    rewards = np.full(n, NAN)
    rewards[leaves] = draw(st.lists(st.sampled_from([0.0, 1.0]) | st.floats(0, 1), min_size=int(leaves.sum()),
                                    max_size=int(leaves.sum())))
    return parent, rewards


@settings(max_examples=80, deadline=None)
@given(trees())
def test_random_tree_properties(tree):
    parent, leaf_rewards = tree
    r = propagate_rewards(parent, leaf_rewards)
    inner = ~leaf_mask(parent)
    for v in np.flatnonzero(inner):  # every inner node is the mean of its children
        assert r[v] == pytest.approx(r[parent == v].mean())
    assert np.all((r >= 0) & (r <= 1))
    adv, mask = treerpo_advantages(parent, r)
    assert adv[0] == 0.0 and not mask[0]
    for v in np.flatnonzero(inner):
        kids = np.flatnonzero(parent == v)
        if np.ptp(r[kids]) == 0:  # all siblings equal: advantage 0 and pruned
            assert np.all(adv[kids] == 0.0) and not mask[kids].any()
        else:  # advantages share the sign of r - mu and sum to 0 within the sibling group
            dev = r[kids] - r[kids].mean()
            clear = np.abs(dev) > 1e-9
            assert np.all(np.sign(adv[kids][clear]) == np.sign(dev[clear]))
            assert abs(adv[kids].sum()) < 1e-6 * max(1.0, np.abs(adv[kids]).max())
            assert mask[kids].all() == (np.ptp(r[kids]) > 0.1)
