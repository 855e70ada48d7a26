"""Layer 4: verifiers. The last boxed answer against a ground truth (math-verify in bounded worker processes),
the synthetic task's exact check, and the router that picks one by `data_source`.

Names are imported on first use: the data layer's synthetic task imports `rewards.boxed`, and the router imports
that task, so eager imports here would be circular.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "last_boxed": "treepo_ray.rewards.boxed",
    "normalize_answer": "treepo_ray.rewards.boxed",
    "MathVerifier": "treepo_ray.rewards.math",
    "MathVerifyConfig": "treepo_ray.rewards.math",
    "compute_score": "treepo_ray.rewards.math",
    "BatchScorer": "treepo_ray.rewards.router",
    "score": "treepo_ray.rewards.router",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treepo_ray.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
