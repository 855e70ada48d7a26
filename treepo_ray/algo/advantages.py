"""Trajectory-level credit assignment: GRPO group advantages, DAPO group filter, TreePO subgroup scores, whitening.

Empty input: every function here that maps a group (or batch) of values to per-value outputs returns an empty
float array for an empty input; `dapo_keep_group` of an empty group is False (it has no learning signal).
NaN/inf rewards always raise ValueError naming the offending index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treepo_ray.algo._checks import finite_1d

WEIGHTINGS = ("average", "size")


def grpo_advantages(rewards, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """GRPO advantage of each member of one group: (R - mean) / (std + eps), or R - mean without `scale`.

    Shao et al. 2024 (DeepSeekMath), eq. for outcome supervision. `std` is the population std (ddof=0) of the
    group; verl/TRL use ddof=1, which differs by a factor sqrt((G-1)/G). A one-member group gets 0.
    """
    r = finite_1d("rewards", rewards)
    if r.size == 0:
        return r
    centred = r - r.mean()
    if not scale:
        return centred
    return centred / (r.std() + eps)


def dapo_keep_group(rewards) -> bool:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11): keep a group only if its rewards are not all equal.

    An all-equal group gives every member advantage 0, so it carries no gradient. Empty group -> False.
    """
    r = finite_1d("rewards", rewards)
    return bool(r.size > 0 and r.max() > r.min())


def treepo_scores(
    paths: Sequence[Sequence[int]],
    rewards,
    *,
    weighting: str = "average",
    include_root: bool = True,
    skip_uniform_subgroups: bool = False,
) -> np.ndarray:
    """TreePO per-trajectory score for one prompt: the mean over subgroup levels of (R_i - level mean).

    TreePO (Li et al. 2025) eq. 5 numerator, with the size-weighted variant of eq. 6; the division by a std is
    replaced by batch whitening (`whiten`) across all prompts, as the issue prescribes.

    `paths[i]` lists the node ids of trajectory i from its first generated segment to its last (prompt
    excluded). For trajectory i, level 0 is every trajectory of the prompt; level d (1 <= d <= len(paths[i]))
    is the trajectories j with len(paths[j]) >= d whose first d node ids equal those of i. Levels d >= 1 with
    a single member are skipped; with `skip_uniform_subgroups`, levels d >= 1 whose rewards are all equal are
    skipped too; `include_root=False` drops level 0. With weighting="average" the score is the plain mean of
    (R_i - mean of level) over kept levels; with weighting="size" each level is weighted by its size. A
    trajectory with no kept level scores 0. An empty path is allowed (only level 0 can apply to it).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    r = finite_1d("rewards", rewards)
    if len(paths) != r.size:
        raise ValueError(f"paths has {len(paths)} trajectories but rewards has {r.size}")
    n = r.size
    if n == 0:
        return np.zeros(0)
    rows = [tuple(p) for p in paths]
    lengths = np.array([len(p) for p in rows])
    total = np.zeros(n)  # weighted sum of (R_i - level mean) over kept levels
    weight = np.zeros(n)  # sum of level weights over kept levels

    if include_root:
        total += (r - r.mean()) * (n if weighting == "size" else 1)
        weight += n if weighting == "size" else 1

    # group[i]: id of trajectory i's subgroup at the previous depth; refining it by the next node id gives
    # the subgroup of "same first d node ids" without comparing whole prefixes.
    group = np.zeros(n, dtype=np.int64)
    for d in range(1, int(lengths.max(initial=0)) + 1):
        alive = np.flatnonzero(lengths >= d)
        ids: dict[tuple, int] = {}
        for i in alive:
            group[i] = ids.setdefault((int(group[i]), rows[i][d - 1]), len(ids))
        g = group[alive]
        size = np.bincount(g)
        mean = np.bincount(g, weights=r[alive]) / size
        keep = size[g] > 1
        if skip_uniform_subgroups:
            hi = np.full(size.size, -np.inf)
            lo = np.full(size.size, np.inf)
            np.maximum.at(hi, g, r[alive])
            np.minimum.at(lo, g, r[alive])
            keep &= hi[g] > lo[g]
        w = size[g].astype(np.float64) if weighting == "size" else np.ones(alive.size)
        w = np.where(keep, w, 0.0)
        total[alive] += w * (r[alive] - mean[g])
        weight[alive] += w

    out = np.zeros(n)
    np.divide(total, weight, out=out, where=weight > 0)
    return out


def whiten(values, weights=None, eps: float = 1e-8) -> np.ndarray:
    """Normalise a batch to zero mean and unit variance: (v - mean) / sqrt(var + eps).

    With `weights` (e.g. each trajectory's token count) mean and (biased) variance are weighted, so the result
    has zero mean and unit variance over tokens; TreePO normalises its averaged subgroup scores over the whole
    batch this way (the REINFORCE++-style global normalisation the paper cites). A constant batch maps to 0.
    """
    v = finite_1d("values", values)
    if weights is None:
        w = np.ones_like(v)
    else:
        w = finite_1d("weights", weights)
        if w.shape != v.shape:
            raise ValueError(f"weights has shape {w.shape} but values has shape {v.shape}")
        if np.any(w < 0):
            raise ValueError(f"weights[{int(np.flatnonzero(w < 0)[0])}] is negative; weights must be >= 0")
    if v.size == 0:
        return v
    if w.sum() <= 0:
        raise ValueError("weights sum to 0; at least one value needs a positive weight")
    mean = np.average(v, weights=w)
    var = np.average((v - mean) ** 2, weights=w)
    return (v - mean) / np.sqrt(var + eps)
