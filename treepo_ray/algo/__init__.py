"""Layer 1: the algorithms (one file each: grpo, dapo, treepo, treerpo, catpo; spec.py, algorithms.py), their
credit assignment and the one policy loss (numpy; torch only for the loss). No Ray, no model."""

from treepo_ray.algo.algorithms import ALGORITHMS, AlgoConfig
from treepo_ray.algo.advantages import dapo_keep_group, grpo_advantages, treepo_scores, whiten
from treepo_ray.algo.informativeness import (
    DEAD_CORRECT,
    DEAD_WRONG,
    INFORMATIVE,
    REGIMES,
    STALE,
    classify_tree,
    informativeness,
    informativeness_weights,
    leaf_pass_rate,
    tree_informativeness,
)
from treepo_ray.algo.losses import LossConfig, kl_penalty, tree_policy_loss
from treepo_ray.algo.spec import Algorithm
from treepo_ray.algo.treerpo import leaf_mask, propagate_rewards, treerpo_advantages

__all__ = [
    "ALGORITHMS",
    "AlgoConfig",
    "Algorithm",
    "DEAD_CORRECT",
    "DEAD_WRONG",
    "INFORMATIVE",
    "REGIMES",
    "STALE",
    "LossConfig",
    "classify_tree",
    "dapo_keep_group",
    "grpo_advantages",
    "informativeness",
    "informativeness_weights",
    "kl_penalty",
    "leaf_mask",
    "leaf_pass_rate",
    "propagate_rewards",
    "treepo_scores",
    "tree_informativeness",
    "tree_policy_loss",
    "treerpo_advantages",
    "whiten",
]
