"""CATPO: TreeRPO's trees and credit, plus three phases of its own.

    sampler, credit, loss   TreeRPO's (treerpo.py; algo.treerpo)
    phase 2 (score)         right after a tree is verified, on its scheduler: F(T) from the rollout's own log-probs
                            (no extra forward pass) and the tree's regime (Table 1: algo.catpo.tau_low, tau_high,
                            var_cut); `score_tree`
    phase 3 (heal)          a dead-wrong tree is healed by the policy's own critique (healing/critique.py, run by the
                            healer actor, runtime/healer.py; algo.catpo.healing), then scored again
    phase 4 (weights)       each tree's advantages scaled by w(T) = F / mean F over the batch (eq. 6; `catpo_weights`)
    metrics                 trees per regime, F before and after healing, what healing did and cost (`catpo/*`)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treepo_ray.algo.informativeness import (
    DEAD_WRONG,
    REGIMES,
    classify_tree,
    informativeness_weights,
    tree_informativeness,
)
from treepo_ray.algo.treerpo import TreeRPO
from treepo_ray.tree.tree import Tree


@dataclass
class HealingConfig:
    """algo.catpo.healing: phase 3's settings (paper Table 5)."""

    epsilon: float = 0.05
    """A node is the failure point when all its children have propagated reward below this."""
    num_refinements: int = 4
    """k: corrected continuations grafted per healed tree."""
    critique_temperature: float = 0.3
    """Sampling temperature of the critique."""
    critique_max_tokens: int = 256
    """Length cap of the critique."""
    refine_temperature: float = 0.6
    """Sampling temperature of the corrected continuations."""
    step_len: int = 0
    """L_step: each grafted continuation is truncated to this many tokens. 0 = the tree's step length
    (rollout.treerpo.step_len); a CritiqueHealer needs it >= 1."""
    logprob_temperature: float = 0.0
    """Temperature of the grafted tokens' teacher-forced log-probs (the learner's behaviour log-probs). 0 = the
    tree's sampling temperature (rollout.temperature)."""
    prompts_path: str = ""
    """YAML file with the `critique` and `refine` templates (one set, or one set per data source plus `default`);
    empty = the packaged healing/prompts.yaml."""


@dataclass
class CatpoConfig:
    """algo.catpo: CATPO's informativeness thresholds and healing (paper Tables 1 and 5)."""

    tau_low: float = 0.025
    """F at or below this (with near-unanimous leaves) makes a tree dead-correct or dead-wrong."""
    tau_high: float = 0.10
    """F above this makes a tree informative; between the two it is stale."""
    var_cut: float = 0.05
    """Dead-tree variance cutoff: p (1 - p) below this counts as near-unanimous."""
    heal: bool = True
    """Phase 3: critique-guided healing of dead-wrong trees (off = score and weight only)."""
    weighting: bool = True
    """Phase 4: scale each tree's advantages by w(T) = F / mean F (off = TreeRPO's uniform weights)."""
    healing: HealingConfig = field(default_factory=HealingConfig)
    """Healing settings (k, temperatures, critique length, prompts file)."""
    heal_concurrency: int = 8
    """Trees the healer actor heals at once (each mostly waits on the generator pool)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.tau_low <= self.tau_high:
            raise ValueError(f"algo.catpo: need 0 <= tau_low ({self.tau_low}) <= tau_high ({self.tau_high})")
        if not self.var_cut > 0:
            raise ValueError(f"algo.catpo.var_cut = {self.var_cut}; it must be > 0")
        if self.heal_concurrency < 1:
            raise ValueError(f"algo.catpo.heal_concurrency = {self.heal_concurrency}; it must be >= 1")


def score_tree(tree: Tree, tau_low: float, tau_high: float, var_cut: float) -> dict:
    """Phase 2: F(T), p and the regime of a verified tree (thresholds of CATPO Table 1), stored in
    tree.meta["catpo"] and returned.

    The first call records the sampled tree's figures ("F0", "p0", "regime0"); later calls (after healing) update
    only the current ones ("F", "p", "regime"), which the loss weights use (CATPO eq. 6 weights the healed tree).
    """
    F, p = tree_informativeness(tree)
    regime = classify_tree(F, p, tau_low, tau_high, var_cut)
    info = tree.meta.setdefault("catpo", {})
    if "F0" not in info:
        info.update(F0=F, p0=p, regime0=regime)
    info.update(F=F, p=p, regime=regime)
    return info


def needs_healing(tree: Tree) -> bool:
    """Whether the sampled tree was dead-wrong (the only regime that is healed)."""
    return tree.meta.get("catpo", {}).get("regime0") == DEAD_WRONG


def record_heal(tree: Tree, result, error: str = "") -> None:
    """Keep what one healing attempt did (a critique.HealResult, or an error message) in tree.meta["catpo"]."""
    info = tree.meta.setdefault("catpo", {})
    if error:
        info["heal"] = {"error": error}
        return
    info["heal"] = {"failure_node": result.failure_node, "grafted": len(result.grafted),
                    "correct": int(sum(r > 0 for r in result.rewards)), "prompt_tokens": result.prompt_tokens,
                    "generated_tokens": result.generated_tokens, "critique": result.critique}


def catpo_weights(trees: list[Tree]) -> list[float]:
    """Phase 4: w(T) = F(T) / mean F over the batch (CATPO eq. 6), from each tree's current (healed) F.

    A detached constant: the learner multiplies the tree's advantages by it (TrainSample.weight)."""
    return [float(w) for w in informativeness_weights([tree_informativeness(t)[0] for t in trees])]


def catpo_metrics(trees: list[Tree], weights: list[float] | None = None) -> dict:
    """Per-step CATPO figures: trees per regime as sampled (phase 2), mean F before and after healing, what
    healing attempted, healed (a grafted branch verified correct) and cost, and the spread of the loss weights."""
    infos = [t.meta.get("catpo") for t in trees]
    unscored = [t.query_id for t, i in zip(trees, infos) if i is None]
    if unscored:
        raise ValueError(f"tree {unscored[0]!r} was never scored by score_tree (is algo.name catpo?)")
    if not trees:
        return {}
    out = {f"catpo/{r}": float(sum(i["regime0"] == r for i in infos)) for r in REGIMES}
    out["catpo/F_mean_sampled"] = float(np.mean([i["F0"] for i in infos]))
    out["catpo/F_mean"] = float(np.mean([i["F"] for i in infos]))
    heals = [i["heal"] for i in infos if "heal" in i]
    done = [h for h in heals if "error" not in h]
    healed = sum(h["correct"] > 0 for h in done)
    out.update({
        "catpo/heal_attempts": float(len(heals)),
        "catpo/heal_errors": float(len(heals) - len(done)),
        "catpo/healed": float(healed),
        # CATPO H2: share of the dead-wrong trees that have at least one correct branch after healing.
        "catpo/healed_share": healed / len(heals) if heals else float("nan"),
        "catpo/heal_F_improved": float(sum(i["F"] > i["F0"] for i in infos if "heal" in i)),
        "catpo/heal_generated_tokens": float(sum(h["generated_tokens"] for h in done)),
        "catpo/heal_prompt_tokens": float(sum(h["prompt_tokens"] for h in done)),
        "catpo/grafted": float(sum(h["grafted"] for h in done)),
    })
    if weights:
        out["catpo/weight_max"] = float(max(weights))
        out["catpo/weight_zero_share"] = float(np.mean([w == 0 for w in weights]))
    return out


class CATPO(TreeRPO):
    name = "catpo"

    def healing(self, cfg) -> CatpoConfig | None:
        return cfg.catpo if cfg.catpo.heal else None

    def score(self, tree: Tree, cfg) -> None:
        c = cfg.catpo
        score_tree(tree, c.tau_low, c.tau_high, c.var_cut)

    def needs_healing(self, tree: Tree) -> bool:
        return needs_healing(tree)

    def record_heal(self, tree: Tree, result, error: str = "") -> None:
        record_heal(tree, result, error)

    def tree_weights(self, trees: list[Tree], cfg) -> list[float] | None:
        return catpo_weights(trees) if cfg.catpo.weighting else None

    def metrics(self, trees: list[Tree], weights: list[float] | None) -> dict:
        return catpo_metrics(trees, weights)
