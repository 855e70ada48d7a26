"""DAPO (Yu et al. 2025): GRPO's sampling and group advantage, trained with DAPO's protocol.

    sampler           sequential, as GRPO
    credit            GRPO's (algo.grpo)
    dynamic_sampling  prompts whose answers all scored alike are dropped and refilled (eq. 11)
    loss              clip-higher 0.2 / 0.28 (eq. 10), token-level mean, no KL
"""

from __future__ import annotations

from treepo_ray.algo.credit import Advantage
from treepo_ray.algo.grpo import group_advantages
from treepo_ray.algo.spec import Algorithm
from treepo_ray.tree.tree import Tree

DAPO_LOSS = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0}
"""DAPO's loss, which TreePO adopts."""


class DAPO(Algorithm):
    name = "dapo"
    sampler = "sequential"
    loss = DAPO_LOSS
    dynamic_sampling = True

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        return group_advantages(trees, cfg)
