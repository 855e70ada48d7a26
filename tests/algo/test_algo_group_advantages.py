"""GRPO advantages, DAPO group filter and batch whitening: hand-computed values, edge cases, properties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepo_ray.algo import dapo_keep_group, grpo_advantages, whiten

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


def test_grpo_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, 1.0])
    # rewards 1, 0, 0, 0: mean 0.25, std sqrt(3)/4
    adv = grpo_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    s = math.sqrt(3) / 4
    np.testing.assert_allclose(adv, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])


def test_grpo_eps_and_unscaled():
    adv = grpo_advantages([2.0, 0.0], eps=1.0)  # (R - 1) / (1 + 1)
    np.testing.assert_allclose(adv, [0.5, -0.5])
    np.testing.assert_allclose(grpo_advantages([3.0, 1.0, 2.0], scale=False), [1.0, -1.0, 0.0])


def test_grpo_degenerate_groups():
    np.testing.assert_array_equal(grpo_advantages([0.7]), [0.0])
    np.testing.assert_array_equal(grpo_advantages([1.0, 1.0, 1.0]), [0.0, 0.0, 0.0])
    assert grpo_advantages([]).shape == (0,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_grpo_rejects_non_finite(bad):
    with pytest.raises(ValueError, match=r"rewards\[1\] .*finite"):
        grpo_advantages([1.0, bad, 0.0])


def test_dapo_keep_group():
    assert dapo_keep_group([0.0, 1.0, 0.0])
    assert not dapo_keep_group([1.0, 1.0, 1.0])
    assert not dapo_keep_group([0.0, 0.0])
    assert not dapo_keep_group([0.5])
    assert not dapo_keep_group([])
    with pytest.raises(ValueError, match="finite"):
        dapo_keep_group([0.0, float("nan")])


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=2, max_size=20))
def test_grpo_properties(rewards):
    adv = grpo_advantages(rewards)
    assert abs(adv.sum()) < 1e-6
    assert dapo_keep_group(rewards) == bool(np.ptp(rewards) > 0)
    if np.std(rewards) > 1e-3:
        assert abs(np.std(adv) - 1.0) < 1e-3


def test_whiten_by_hand():
    np.testing.assert_allclose(whiten([1.0, 3.0], eps=0.0), [-1.0, 1.0])
    # weights 3, 1: mean 1.5, var (3 * 0.25 + 2.25) / 4 = 0.75
    np.testing.assert_allclose(whiten([1.0, 3.0], weights=[3, 1], eps=0.0),
                               [-0.5 / math.sqrt(0.75), 1.5 / math.sqrt(0.75)])


def test_whiten_weights_equal_token_repetition():
    # Weighting by token counts is the same as whitening every token's copy of the value.
    values, counts = np.array([0.3, -1.2, 2.0]), np.array([4, 1, 2])
    per_token = whiten(np.repeat(values, counts))
    np.testing.assert_allclose(np.repeat(whiten(values, weights=counts), counts), per_token)


def test_whiten_edges_and_errors():
    assert whiten([]).shape == (0,)
    np.testing.assert_array_equal(whiten([2.0, 2.0, 2.0]), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"values\[0\]"):
        whiten([float("inf"), 1.0])
    with pytest.raises(ValueError, match="negative"):
        whiten([1.0, 2.0], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="shape"):
        whiten([1.0, 2.0], weights=[1.0])
    with pytest.raises(ValueError, match="sum to 0"):
        whiten([1.0, 2.0], weights=[0.0, 0.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, st.integers(1, 50)), min_size=2, max_size=30))
def test_whiten_zero_mean_unit_variance(rows):
    values = np.array([v for v, _ in rows])
    weights = np.array([w for _, w in rows], dtype=float)
    out = whiten(values, weights=weights)
    assert abs(np.average(out, weights=weights)) < 1e-6
    var = np.average((values - np.average(values, weights=weights)) ** 2, weights=weights)
    if var > 1e-3:
        assert abs(np.average(out**2, weights=weights) - 1.0) < 1e-4
