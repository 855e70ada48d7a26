"""Layer 3: verifiers. `default_compute_score` picks a built-in scorer by `data_source` as verl's does (gsm8k's
`####`, the last boxed answer against a ground truth with math-verify in bounded worker processes, the synthetic
task's exact check); a user's `custom_reward_function` runs in the same bounded workers. Imports nothing from data/.
"""

from treepo_ray.rewards.boxed import last_boxed, normalize_answer
from treepo_ray.rewards.custom import RewardFunctionConfig, check_reward_function
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig, compute_score
from treepo_ray.rewards.router import BatchScorer, check_row, default_compute_score, score

__all__ = ["BatchScorer", "MathVerifier", "MathVerifyConfig", "RewardFunctionConfig", "check_reward_function",
           "check_row", "compute_score", "default_compute_score", "last_boxed", "normalize_answer", "score"]
