"""Input checks shared by the credit-assignment functions (clear ValueErrors, never silent NaNs)."""

from __future__ import annotations

import numpy as np


def finite_1d(name: str, values) -> np.ndarray:
    """Return `values` as a 1-D float64 array, raising ValueError if it is not 1-D or holds NaN/inf."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] is {arr[i]}; {name} must be finite (no NaN/inf)")
    return arr


def parent_array(parent) -> np.ndarray:
    """Check a tree's parent array (parent[0] == -1, 0 <= parent[i] < i) and return it as int64."""
    arr = np.asarray(parent)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"parent must be a non-empty 1-D array (node 0 is the root), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"parent must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr[0] != -1:
        raise ValueError(f"parent[0] must be -1 (node 0 is the root), got {arr[0]}")
    idx = np.arange(arr.size)
    bad = np.flatnonzero((arr[1:] < 0) | (arr[1:] >= idx[1:])) + 1
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parent[{i}] = {arr[i]}; every non-root node needs 0 <= parent[i] < i")
    return arr


def has_children(parent: np.ndarray) -> np.ndarray:
    """Boolean mask over nodes: True where the node has at least one child."""
    out = np.zeros(parent.size, dtype=bool)
    out[parent[1:]] = True
    return out
