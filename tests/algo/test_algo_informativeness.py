"""CATPO informativeness F(T), Table 1 regimes and loss weights: hand-computed trees and random-tree bounds."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepo_ray.algo import (
    DEAD_CORRECT,
    DEAD_WRONG,
    INFORMATIVE,
    STALE,
    classify_tree,
    informativeness,
    informativeness_weights,
    leaf_mask,
    leaf_pass_rate,
    propagate_rewards,
)

NAN = float("nan")
# root 0 -> 1, 2;  1 -> 3, 4;  2 -> 5, 6. Leaves 3..6 with rewards 1, 0, 0, 0.
PARENT = np.array([-1, 0, 0, 1, 1, 2, 2])
LEAVES = np.array([NAN, NAN, NAN, 1.0, 0.0, 0.0, 0.0])
NODE_R = propagate_rewards(PARENT, LEAVES)  # [0.25, 0.5, 0, 1, 0, 0, 0]


def test_pass_rate():
    assert leaf_pass_rate([1.0, 0.0, 0.0, 0.0]) == 0.25
    assert leaf_pass_rate([0.5, -1.0]) == 0.5  # "positive reward", not "reward 1"
    with pytest.raises(ValueError, match="empty"):
        leaf_pass_rate([])


def test_uncorrelated_tree_keeps_full_variance():
    # non-root rewards .5, 0, 1, 0, 0, 0 (mean .25); log-probs chosen so the covariance is exactly 0:
    # .25 * (-1) - .25 * (-1) + .75 * (-2) - .25 * (-6) = 0, so rho = 0 and F = p (1 - p) = 3/16.
    logp = np.array([0.0, -1.0, -1.0, -2.0, -2.0, -2.0, -2.0])
    F = informativeness(LEAVES[3:], logp, NODE_R)
    assert F == pytest.approx(3 / 16)
    assert classify_tree(F, 0.25) == INFORMATIVE


def test_perfectly_correlated_tree_is_stale():
    logp = 2.0 * NODE_R - 5.0  # rho = 1: the policy's confidence explains the rewards
    logp[0] = 123.0  # the root is ignored
    F = informativeness(LEAVES[3:], logp, NODE_R)
    assert F == pytest.approx(0.0, abs=1e-12)
    # F <= tau_low but p (1 - p) = 0.1875 >= 0.05: not dead, stale (the case Table 1 leaves open)
    assert classify_tree(F, 0.25) == STALE


def test_partial_correlation_by_hand():
    # root -> three leaves with rewards 0, 0, 1 and log-prob sums -3, -2, -1: cov 1, sxx 2, syy 2/3,
    # rho = 1 / sqrt(4/3) = sqrt(3)/2, rho^2 = 3/4; p = 1/3, so F = (2/9) * (1/4) = 1/18.
    parent = [-1, 0, 0, 0]
    node_r = propagate_rewards(parent, [NAN, 0.0, 0.0, 1.0])
    F = informativeness([0.0, 0.0, 1.0], [0.0, -3.0, -2.0, -1.0], node_r)
    assert F == pytest.approx(1 / 18)
    assert classify_tree(F, 1 / 3) == STALE  # 0.025 < 1/18 <= 0.10


def test_undefined_correlation_is_zero():
    # a single non-root node, or constant log-probs: rho is undefined and taken as 0
    assert informativeness([1.0, 0.0], [0.0, -1.0], [0.5, 0.5]) == pytest.approx(0.25)
    assert informativeness([1.0, 0.0], [0.0, -1.0, -1.0], [0.5, 1.0, 0.0]) == pytest.approx(0.25)
    assert informativeness([1.0, 1.0], [0.0, -1.0, -2.0], [1.0, 1.0, 1.0]) == 0.0  # all correct


def test_informativeness_bad_input():
    with pytest.raises(ValueError, match=r"leaf_rewards\[1\]"):
        informativeness([1.0, NAN], [0.0, -1.0], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"node_logprob_sums\[1\] is -inf"):
        informativeness([1.0], [0.0, -np.inf], [1.0, 1.0])
    with pytest.raises(ValueError, match="shape"):
        informativeness([1.0], [0.0, -1.0], [1.0])
    with pytest.raises(ValueError, match="empty"):
        informativeness([], [0.0], [1.0])


@pytest.mark.parametrize(
    "F, p, expected",
    [
        (0.0, 0.0, DEAD_WRONG),
        (0.0, 1.0, DEAD_CORRECT),
        (0.025, 0.02, DEAD_WRONG),  # F == tau_low still counts as low; v = 0.0196 < 0.05
        (0.025, 0.98, DEAD_CORRECT),
        (0.0, 0.5, STALE),  # v = 0.25 >= var_cut: leaves disagree, rho^2 ~ 1
        (0.03, 0.05, STALE),  # v = 0.0475 < 0.05 but F > tau_low
        (0.10, 0.5, STALE),  # F == tau_high is still stale
        (0.1000001, 0.5, INFORMATIVE),
        (0.25, 0.5, INFORMATIVE),
    ],
)
def test_classify_table_1(F, p, expected):
    assert classify_tree(F, p) == expected


def test_classify_p_half_boundary_and_errors():
    # p = 0.5 goes to dead-wrong (Table 1: p <= 0.5), given a var_cut that lets v = 0.25 count as low
    assert classify_tree(0.0, 0.5, var_cut=0.3) == DEAD_WRONG
    assert classify_tree(0.0, 0.5000001, var_cut=0.3) == DEAD_CORRECT
    with pytest.raises(ValueError, match="F = nan"):
        classify_tree(NAN, 0.5)
    with pytest.raises(ValueError, match="p = 1.5"):
        classify_tree(0.1, 1.5)
    with pytest.raises(ValueError, match="tau_low"):
        classify_tree(0.1, 0.5, tau_low=0.2, tau_high=0.1)


def test_weights():
    np.testing.assert_allclose(informativeness_weights([0.2, 0.0, 0.1]), [2.0, 0.0, 1.0])
    np.testing.assert_array_equal(informativeness_weights([0.0, 0.0]), [1.0, 1.0])
    assert informativeness_weights([]).shape == (0,)
    with pytest.raises(ValueError, match="negative"):
        informativeness_weights([0.1, -0.1])
    with pytest.raises(ValueError, match=r"F\[0\]"):
        informativeness_weights([NAN, 0.1])


@st.composite
def scored_trees(draw, max_nodes=30):
    n = draw(st.integers(1, max_nodes))
    parent = np.array([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    leaves = leaf_mask(parent)
    k = int(leaves.sum())
    rewards = np.full(n, NAN)
    rewards[leaves] = draw(st.lists(st.sampled_from([0.0, 1.0]) | st.floats(0, 1), min_size=k, max_size=k))
    logp = np.array(draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n)))
    return rewards[leaves], logp, propagate_rewards(parent, rewards)


@settings(max_examples=80, deadline=None)
@given(scored_trees())
def test_random_trees_bounds(tree):
    leaf_r, logp, node_r = tree
    F = informativeness(leaf_r, logp, node_r)
    p = leaf_pass_rate(leaf_r)
    assert 0.0 <= F <= p * (1 - p) + 1e-12 <= 0.25 + 1e-12
    regime = classify_tree(F, p)
    if p in (0.0, 1.0):
        assert regime == (DEAD_CORRECT if p == 1.0 else DEAD_WRONG)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.just(0.0) | st.floats(1e-6, 0.25), min_size=1, max_size=20))
def test_weights_mean_one(F):
    w = informativeness_weights(F)
    assert np.all(w >= 0)
    assert math.isclose(w.mean(), 1.0, rel_tol=1e-9)
