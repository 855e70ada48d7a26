"""Evaluation metrics over n sampled answers per problem: Pass@1 (Avg@k), pass@k, Major@k; per data source.

Pure functions of per-sample correctness and extracted answers (numpy only).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from treepo_ray.rewards.boxed import normalize_answer


def mean_accuracy(correct: Sequence[bool | float]) -> float:
    """Pass@1 as CATPO reports it (Avg@k): the mean correctness of all k samples of one problem."""
    if len(correct) == 0:
        raise ValueError("mean_accuracy of no samples")
    return float(np.mean(np.asarray(correct, dtype=float)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Chen et al. 2021 (Codex), eq. 1 and its numerically stable product form
    1 - prod_{i=n-c+1}^{n} (1 - k / i).
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def vote_keys(preds: Sequence[str], correct: Sequence[bool | float]) -> list[str | None]:
    """The ballot of each sample: every correct answer votes for one shared key (they all equal the ground truth,
    so they are the same answer however differently written); a wrong one votes for its normal form; a sample
    without an answer casts no vote (None)."""
    if len(preds) != len(correct):
        raise ValueError(f"{len(preds)} answers but {len(correct)} correctness values")
    out: list[str | None] = []
    for p, ok in zip(preds, correct):
        if ok:
            out.append("\x00correct")
        elif p is None or not str(p).strip():
            out.append(None)
        else:
            out.append(normalize_answer(str(p)))
    return out


def majority_correct(keys: Sequence[str | None]) -> float:
    """Accuracy of the majority answer among `keys` (from `vote_keys`); a tie counts as a uniformly random pick
    among the tied answers, so it scores the expected accuracy (the fraction of tied answers that are correct)."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [k for k, v in counts.items() if v == top]
    return float("\x00correct" in tied) / len(tied)


def major_at_k(preds: Sequence[str], correct: Sequence[bool | float], k: int, resamples: int = 1000,
               seed: int = 0) -> float:
    """Major@k of one problem from n >= k samples: majority-vote accuracy of k answers, averaged over `resamples`
    random sets of k drawn without replacement from the n (TreePO, sec. 4: Major@16 over 1,000 sets of 16).
    With k == n there is one set and the result is exact."""
    keys = vote_keys(preds, correct)
    n = len(keys)
    if not 1 <= k <= n:
        raise ValueError(f"major_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if k == n:
        return majority_correct(keys)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    return float(np.mean([majority_correct([keys[i] for i in rng.choice(n, size=k, replace=False)])
                          for _ in range(resamples)]))


def problem_metrics(preds: Sequence[str], correct: Sequence[bool | float], ks: Sequence[int],
                    resamples: int = 1000, seed: int = 0) -> dict[str, float]:
    """pass@1 (mean over the n samples), pass@k and major@k for each k <= n of one problem."""
    n = len(correct)
    c = int(round(sum(float(x) for x in correct)))
    out = {"pass@1": mean_accuracy(correct)}
    for k in ks:
        if k > n:
            continue
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"major@{k}"] = major_at_k(preds, correct, k, resamples, seed)
    return out


def summarize(problems: Sequence[dict], ks: Sequence[int] = (1,), resamples: int = 1000,
              seed: int = 0) -> dict[str, float]:
    """Metrics per data source and overall from [{"data_source", "preds", "correct"}, ...] (one dict per problem).

    Keys are "<source>/<metric>" and "overall/<metric>", plus "<source>/problems". A source's metric is the mean
    over its problems; the overall metric is the mean over all problems, i.e. the sources' metrics weighted by
    their problem counts.
    """
    if not problems:
        raise ValueError("summarize needs at least one problem")
    by_source: dict[str, list[dict[str, float]]] = defaultdict(list)
    for i, p in enumerate(problems):
        if not p["correct"]:
            raise ValueError(f"problem {i} has no samples")
        by_source[p["data_source"]].append(problem_metrics(p["preds"], p["correct"], ks, resamples, seed + i))
    out: dict[str, float] = {}
    everything = [m for ms in by_source.values() for m in ms]
    for name, ms in sorted(by_source.items()) + [("overall", everything)]:
        out[f"{name}/problems"] = len(ms)
        for key in ms[0]:
            values = [m[key] for m in ms if key in m]
            if len(values) == len(ms):  # a k larger than some problem's n is left out rather than half-averaged
                out[f"{name}/{key}"] = float(np.mean(values))
    return out
