"""The algorithms (one file each, spec.py says what one is) and the job's `algo` config section.

Adding an algorithm: a file with its `Algorithm` subclass (and its config section, if it has knobs of its own), its
instance in ALGORITHMS below, its section as a field of AlgoConfig, and a paper config in jobs/configs/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treepo_ray.algo.catpo import CATPO, CatpoConfig
from treepo_ray.algo.dapo import DAPO
from treepo_ray.algo.grpo import GRPO, GRPOCreditConfig
from treepo_ray.algo.overlong import OverlongConfig
from treepo_ray.algo.spec import Algorithm
from treepo_ray.algo.treepo import TreePO, TreePOCreditConfig, TreePOFlat
from treepo_ray.algo.treerpo import TreeRPO, TreeRPOCreditConfig

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (GRPO(), DAPO(), TreePO(), TreePOFlat(), TreeRPO(), CATPO())}


@dataclass
class AlgoConfig:
    """Which algorithm runs, what every algorithm shares, and each algorithm's own section (the loss lives in
    learner.loss)."""

    name: str = "treepo"
    """grpo | dapo | treepo | treepo_flat (tree sampling, flat GRPO advantage) | treerpo | catpo (TreeRPO trees,
    scored, healed and weighted)."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop prompts whose trajectories all got the same reward, refill from new prompts.
    None = the algorithm's own: on for dapo, treepo and treepo_flat (TreePO trains with DAPO's protocol; a group
    without signal would only shift the batch whitening), off for grpo, treerpo and catpo."""
    oversample: float = 1.0
    """With dynamic sampling: prompts grown per round as a multiple of trainer.prompts_per_step (DAPO/TreePO: 3)."""
    max_extra_rounds: int = 2
    """With dynamic sampling: at most this many extra rounds when too few prompts kept (then train on what is kept)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's overlong reward buffer, applied to trajectory rewards before credit (algo/overlong.py)."""
    loss_preset: bool = True
    """Start learner.loss from the algorithm's own loss (its `loss`); keys set in learner.loss by a YAML file or the
    command line still win. False = learner.loss's plain defaults."""
    correct_threshold: float = 1.0
    """A trajectory counts as correct (accuracy metrics) when its reward is at least this."""
    grpo: GRPOCreditConfig = field(default_factory=GRPOCreditConfig)
    """GRPO's group advantage (grpo, dapo, treepo_flat)."""
    treepo: TreePOCreditConfig = field(default_factory=TreePOCreditConfig)
    """TreePO's subgroup advantage (treepo)."""
    treerpo: TreeRPOCreditConfig = field(default_factory=TreeRPOCreditConfig)
    """TreeRPO's per-node advantage (treerpo, catpo)."""
    catpo: CatpoConfig = field(default_factory=CatpoConfig)
    """CATPO's informativeness thresholds, healing and tree weights (catpo)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name = {self.name!r}; choose one of {tuple(ALGORITHMS)}")
        if self.oversample < 1.0:
            raise ValueError(f"algo.oversample = {self.oversample}; it must be >= 1")
        if self.max_extra_rounds < 0:
            raise ValueError(f"algo.max_extra_rounds = {self.max_extra_rounds}; it must be >= 0")

    @property
    def spec(self) -> Algorithm:
        return ALGORITHMS[self.name]

    @property
    def filters_groups(self) -> bool:
        """Whether DAPO dynamic sampling is on (dynamic_sampling, or the algorithm's default when None)."""
        return self.spec.dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling

    def advantages(self, trees: list) -> list:
        """Every trajectory's advantage as the learner takes it (`out[t][k]`: tree t's k-th trajectory)."""
        return [c.trajectories for c in self.credit(trees)]

    def credit(self, trees: list) -> list:
        """Each tree's credit as the learner takes it (its `credit`: overlong penalty, then its advantages)."""
        return self.spec.credit(trees, self)
