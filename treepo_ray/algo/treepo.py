"""TreePO (Li et al. 2025): segment trees, credit from the subgroups that share a prefix, DAPO's training protocol.

    sampler           treepo (rollout.treepo: segments, branching budget, fallback, early stops; tree/treepo.py)
    credit            per trajectory the mean over its depths of (R - mean of the subgroup sharing its first d
                      segments) (eq. 5; algo.treepo), then one whitening over the whole batch (the official script)
    dynamic_sampling  on: a tree whose paths all scored alike only shifts the batch whitening
    loss              DAPO's (dapo.py)

`treepo_flat` is the paper's ablation "GRPO w/ TreePO sampling": the same trees, GRPO's flat group advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

from treepo_ray.algo.advantages import WEIGHTINGS, treepo_scores, whiten
from treepo_ray.algo.credit import Advantage, trajectory_rewards
from treepo_ray.algo.dapo import DAPO_LOSS
from treepo_ray.algo.grpo import group_advantages
from treepo_ray.algo.spec import Algorithm
from treepo_ray.tree.tree import Tree

SCALES = ("batch", "prompt")
"""How TreePO scales its subgroup scores: one whitening over the batch, or per prompt by its reward std."""
PROMPT_STD_EPS = 1e-6  # GRPO's epsilon (grpo_advantages): an all-equal prompt scores 0, not a division by 0


@dataclass
class TreePOCreditConfig:
    """algo.treepo: TreePO's advantage (paper sec. 4.2 ablations)."""

    weighting: str = "average"
    """Subgroup aggregation: 'average' (paper default) or 'size'."""
    root_group: bool = True
    """The whole prompt's group is one of each trajectory's levels (False = the paper's no-root ablation)."""
    subgroup_rejection: bool = False
    """Skip subgroups whose rewards are all equal (the paper's subgroup-level rejection ablation)."""
    scale: str = "batch"
    """'batch' whitens the subgroup scores over the whole batch (the official script's REINFORCE++ normalisation);
    'prompt' divides each prompt's scores by the std of its rewards, as GRPO does per group."""
    whiten_by_tokens: bool = True
    """Batch whitening weighted by each trajectory's token count (False = one weight per trajectory)."""

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"algo.treepo.weighting = {self.weighting!r}; choose one of {WEIGHTINGS}")
        if self.scale not in SCALES:
            raise ValueError(f"algo.treepo.scale = {self.scale!r}; choose one of {SCALES}")


class TreePO(Algorithm):
    name = "treepo"
    sampler = "treepo"
    loss = DAPO_LOSS
    dynamic_sampling = True

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        """Eq. 5's numerator per prompt, then with scale 'batch' one whitening over the whole batch (weighted by
        tokens when whiten_by_tokens, so the token-mean loss sees zero-mean unit-variance advantages), with 'prompt'
        each prompt's scores divided by the std of its rewards (a prompt with one success in 16 then weighs as much
        as one with eight)."""
        c = cfg.treepo
        scores, lengths = [], []
        for tree in trees:
            scores.append(treepo_scores(tree.trajectory_paths(), trajectory_rewards(tree), weighting=c.weighting,
                                        include_root=c.root_group, skip_uniform_subgroups=c.subgroup_rejection))
            lengths += [len(tree.response_ids(n)) for n in tree.trajectories]
        if c.scale == "prompt":
            return [(s / (trajectory_rewards(tree).std() + PROMPT_STD_EPS)).tolist() for tree, s in zip(trees, scores)]
        flat = [s for per_tree in scores for s in per_tree]
        if not flat:
            return [[] for _ in trees]
        adv = iter(whiten(flat, weights=lengths if c.whiten_by_tokens else None).tolist())
        return [[next(adv) for _ in per_tree] for per_tree in scores]


class TreePOFlat(TreePO):
    name = "treepo_flat"

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        return group_advantages(trees, cfg)
