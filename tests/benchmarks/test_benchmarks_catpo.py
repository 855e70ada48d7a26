"""The rank statistics of the CATPO benchmark's H1 check (benchmarks/catpo.py), by hand (no Ray, no model)."""

import math

import numpy as np
import pytest

from treepo_ray.benchmarks.catpo import average_ranks, pearson, spearman


def test_average_ranks_share_ties():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert average_ranks(np.array([0.0, 0.0, 0.0])).tolist() == [2.0, 2.0, 2.0]


def test_spearman_is_pearson_of_ranks():
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)  # monotone, not linear
    assert pearson([1, 2, 3, 4], [1, 8, 27, 64]) < 1.0
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # Ties: ranks x = (1.5, 1.5, 3), y = (1, 2, 3): Pearson of those is sqrt(3) / 2.
    assert spearman([0, 0, 5], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # undefined for a constant series
