"""What an algorithm is to the rest of the system: one `Algorithm` object per algorithm, in a file of its own
(grpo.py, dapo.py, treepo.py, treerpo.py, catpo.py), registered in algorithms.py. The job's config, the runtime and
the learner ask the object; nothing outside those files names an algorithm.

An algorithm decides five things:
    sampler           which grower grows its rollouts ('sequential': G i.i.d. paths; 'treepo'; 'treerpo')
    loss              its paper's policy loss, as learner.loss fields (applied under anything set explicitly)
    dynamic_sampling  DAPO's filter and refill of all-equal groups, by default
    per_node          per-node advantages and loss (TreeRPO, CATPO eq. 7: each node once)
    credit            every trajectory's advantage (and each node's, when per_node), from the scored trees
and may add phases of its own, each a no-op here: scoring a tree right after verification, healing dead-wrong trees,
per-tree loss weights and the metrics they give (CATPO).

The methods take the job's whole `algo` config section (AlgoConfig, algorithms.py), so an algorithm reads the shared
keys (overlong buffer) and its own section (algo.<name>).
"""

from __future__ import annotations

from treepo_ray.algo.credit import Advantage, TreeCredit
from treepo_ray.algo.overlong import with_overlong_penalty
from treepo_ray.tree.tree import Tree


class Algorithm:
    """One algorithm; subclasses set the class attributes and implement `advantages` (or `credit`)."""

    name: str = ""
    sampler: str = "sequential"
    loss: dict = {}
    dynamic_sampling: bool = False
    per_node: bool = False

    def advantages(self, trees: list[Tree], cfg) -> list[list[Advantage]]:
        """Every trajectory's advantage (`out[t][k]`: tree t's k-th trajectory), from rewards as given."""
        raise NotImplementedError

    def credit(self, trees: list[Tree], cfg) -> list[TreeCredit]:
        """Each tree's credit as the learner takes it, from the rewards with DAPO's overlong penalty when it is on
        (algo/overlong.py: the filter and the accuracy metrics still see the verifier's rewards)."""
        trees = with_overlong_penalty(trees, cfg.overlong) if cfg.overlong.enable else trees
        return self.tree_credit(trees, cfg)

    def tree_credit(self, trees: list[Tree], cfg) -> list[TreeCredit]:
        return [TreeCredit(a) for a in self.advantages(trees, cfg)]

    # Phases beyond credit (CATPO's); none by default.

    def healing(self, cfg):
        """The settings of healing dead-wrong trees (a healer actor runs) when this run heals, else None."""
        return None

    def score(self, tree: Tree, cfg) -> None:
        """Right after a tree is verified (on its scheduler), and again after it is healed."""

    def needs_healing(self, tree: Tree) -> bool:
        return False

    def record_heal(self, tree: Tree, result, error: str = "") -> None:
        """Keep what one healing attempt did (a healing.critique.HealResult, or why it failed) in the tree."""

    def tree_weights(self, trees: list[Tree], cfg) -> list[float] | None:
        """Per-tree loss weights of a batch (None: every tree weighs 1)."""
        return None

    def metrics(self, trees: list[Tree], weights: list[float] | None) -> dict:
        """The batch's figures of this algorithm's own phases."""
        return {}

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"
