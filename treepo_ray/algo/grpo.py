"""GRPO (Shao et al. 2024, DeepSeekMath): G i.i.d. answers per prompt, each scored against its group.

    sampler   sequential (rollout.sequential: group_size paths of one prompt)
    credit    (R - mean) / (std + eps) over the prompt's group (algo.grpo.scale: false keeps R - mean, Dr. GRPO)
    loss      PPO clip 0.2 / 0.2, per-sequence mean, k3 KL to the reference at 0.001 (learner.loss)
"""

from __future__ import annotations

from dataclasses import dataclass

from treepo_ray.algo.advantages import grpo_advantages
from treepo_ray.algo.credit import Advantage, trajectory_rewards
from treepo_ray.algo.spec import Algorithm
from treepo_ray.tree.tree import Tree

PPO_KL = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.001, "kl_estimator": "k3"}
"""PPO's symmetric clip with a small k3 KL to the reference: GRPO's loss and TreeRPO's (CATPO appendix B)."""


@dataclass
class GRPOCreditConfig:
    """algo.grpo: the group advantage (also DAPO's and treepo_flat's)."""

    scale: bool = True
    """Divide by the group's std (False = only subtract the mean, Dr. GRPO style)."""


def group_advantages(trees: list[Tree], cfg) -> list[list[Advantage]]:
    """One flat group per prompt (algo.grpo)."""
    return [grpo_advantages(trajectory_rewards(tree), scale=cfg.grpo.scale).tolist() for tree in trees]


class GRPO(Algorithm):
    name = "grpo"
    sampler = "sequential"
    loss = {**PPO_KL, "aggregation": "seq-mean"}

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        return group_advantages(trees, cfg)
