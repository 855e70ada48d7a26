"""Layer 4: verifiers. The last boxed answer against a ground truth (math-verify in bounded worker processes),
the synthetic task's exact check, and the router that picks one by `data_source`. Imports nothing from data/.
"""

from treepo_ray.rewards.boxed import last_boxed, normalize_answer
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig, compute_score
from treepo_ray.rewards.router import BatchScorer, score

__all__ = ["BatchScorer", "MathVerifier", "MathVerifyConfig", "compute_score", "last_boxed", "normalize_answer",
           "score"]
