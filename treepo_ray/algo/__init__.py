"""Layer 2: credit assignment and objectives (numpy; torch only for the losses). No Ray."""

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
from treepo_ray.algo.losses import LossConfig, aggregate, kl_penalty, policy_loss
from treepo_ray.algo.treerpo import leaf_mask, propagate_rewards, treerpo_advantages

__all__ = [
    "DEAD_CORRECT",
    "DEAD_WRONG",
    "INFORMATIVE",
    "REGIMES",
    "STALE",
    "LossConfig",
    "aggregate",
    "classify_tree",
    "dapo_keep_group",
    "grpo_advantages",
    "informativeness",
    "informativeness_weights",
    "kl_penalty",
    "leaf_mask",
    "leaf_pass_rate",
    "policy_loss",
    "propagate_rewards",
    "treepo_scores",
    "tree_informativeness",
    "treerpo_advantages",
    "whiten",
]
