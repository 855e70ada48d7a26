"""Reward routing: each `data_source` to its verifier.

The synthetic tasks' rows go to their own exact verifier (cheap, in-process); every other source goes to the math
verifier (boxed answer, math-verify in bounded worker processes). Scores share one scale: `correct_score` for a
right answer, `wrong_score` otherwise, whichever verifier judged it.
"""

from __future__ import annotations

import treepo_ray.rewards.synthetic as synthetic
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig, compute_score

EXACT_SOURCES = {source: synthetic.score for source in synthetic.DATA_SOURCES}
"""data_source -> an in-process exact scorer (solution, ground truth) -> {"score", "acc", "pred"} with score 1/0."""


def _rescale(result: dict, cfg: MathVerifyConfig) -> dict:
    ok = result["acc"] == 1.0
    return {**result, "score": float(cfg.correct_score if ok else cfg.wrong_score)}


def score(data_source: str, solution: str, ground_truth, cfg: MathVerifyConfig | None = None) -> dict:
    """{"score", "acc", "pred"} of one solution, judged by the verifier of its data source."""
    cfg = cfg or MathVerifyConfig()
    exact = EXACT_SOURCES.get(data_source)
    if exact is not None:
        return _rescale(exact(solution, ground_truth), cfg)
    return compute_score(solution, ground_truth, cfg)


class BatchScorer:
    """Scores batches of (data_source, solution, ground_truth) with one math verifier pool; close() when done."""

    def __init__(self, timeout_s: float | None = None, cfg: MathVerifyConfig | None = None):
        """`timeout_s` overrides cfg.timeout_s (the per-solution limit of the math verifier)."""
        cfg = cfg or MathVerifyConfig()
        if timeout_s is not None:
            cfg = MathVerifyConfig(**{**cfg.__dict__, "timeout_s": float(timeout_s)})
        self.cfg = cfg
        self._math: MathVerifier | None = None  # started on the first math item: synthetic-only runs need none

    def score_details(self, items: list[tuple[str, str, object]]) -> list[dict]:
        """{"score", "acc", "pred"} of each (data_source, solution, ground_truth), in order."""
        out: list[dict | None] = [None] * len(items)
        math_idx = []
        for i, item in enumerate(items):
            if len(item) != 3:
                raise ValueError(f"item {i} must be (data_source, solution, ground_truth), got {len(item)} fields")
            source, solution, gt = item
            exact = EXACT_SOURCES.get(source)
            if exact is not None:
                out[i] = _rescale(exact(solution, gt), self.cfg)
            else:
                math_idx.append(i)
        if math_idx:
            if self._math is None:
                self._math = MathVerifier(self.cfg)
            results = self._math.score_batch([items[i][1] for i in math_idx], [items[i][2] for i in math_idx])
            for i, r in zip(math_idx, results):
                out[i] = r
        return out  # type: ignore[return-value]

    def score_batch(self, items: list[tuple[str, str, object]]) -> list[float]:
        """The score of each (data_source, solution, ground_truth), in order."""
        return [r["score"] for r in self.score_details(items)]

    def close(self) -> None:
        if self._math is not None:
            self._math.close()
            self._math = None

    def __enter__(self) -> "BatchScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
