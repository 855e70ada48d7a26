"""The synthetic tasks' verifier: their `data_source`s and the exact check of the boxed integer answer.

The tasks themselves (problems, worked solutions, splits) are treepo_ray.data.synthetic and data.chain; the reward
router sends the rows of DATA_SOURCES here.
"""

from __future__ import annotations

from treepo_ray.rewards.boxed import last_boxed

DATA_SOURCE = "synthetic_addition"
"""`data_source` of the synthetic addition task's rows; the reward router sends it to `score`."""
CHAIN_DATA_SOURCE = "synthetic_chain"
"""`data_source` of the running-sum task's rows (the default synthetic task)."""
DATA_SOURCES = (CHAIN_DATA_SOURCE, DATA_SOURCE)


def score(solution: str, ground_truth) -> dict:
    """{"score", "acc", "pred"} in the math verifier's layout (score 1/0)."""
    pred = last_boxed(solution, max_chars=10_000)
    ok = pred is not None and pred.strip() == str(ground_truth).strip()
    return {"score": float(ok), "acc": float(ok), "pred": "" if pred is None else pred.strip()}


def verify(solution: str, ground_truth) -> bool:
    """Exact check: the last boxed answer is the ground-truth integer, written without sign or leading zeros."""
    return score(solution, ground_truth)["acc"] == 1.0
