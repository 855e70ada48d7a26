"""Layer 1: the rollout tree as data and the growth state machines (pure Python + numpy)."""

from treepo_ray.tree.branches import branch_metrics, branch_points
from treepo_ray.tree.growth import (
    Ask,
    Grower,
    Segment,
    StopRules,
    growth_counters,
    has_complete_boxed,
    has_repetition,
)
from treepo_ray.tree.sequential import SequentialConfig, SequentialGrower
from treepo_ray.tree.tree import FINISH_REASONS, Tree
from treepo_ray.tree.treepo import (
    BudgetStep,
    TreePOConfig,
    TreePOGrower,
    allocate_logprob,
    allocate_uniform,
    branch_budget,
    scheduled,
)
from treepo_ray.tree.treerpo import TreeRPOConfig, TreeRPOGrower

__all__ = [
    "FINISH_REASONS",
    "Ask",
    "BudgetStep",
    "Grower",
    "Segment",
    "SequentialConfig",
    "SequentialGrower",
    "StopRules",
    "Tree",
    "TreePOConfig",
    "TreePOGrower",
    "TreeRPOConfig",
    "TreeRPOGrower",
    "allocate_logprob",
    "allocate_uniform",
    "branch_budget",
    "branch_metrics",
    "branch_points",
    "growth_counters",
    "has_complete_boxed",
    "has_repetition",
    "scheduled",
]
