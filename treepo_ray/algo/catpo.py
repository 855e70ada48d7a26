"""CATPO's plain parts: phase 2 (score and classify each verified tree), the bookkeeping of phase 3 (what healing
did), phase 4 (per-tree loss weights) and the per-step metrics.

CATPO (see DESIGN.md and papers/catpo.txt) samples TreeRPO trees. Right after a tree is verified, its scheduler
calls `score_tree` (F(T) from the rollout's own log-probs, no extra forward pass) and, for a dead-wrong tree, the
healer (runtime/healer.py); `score_tree` then runs again on the healed tree. Each tree's advantages are weighted by
w(T) = F / mean F over the batch (`catpo_weights`).
"""

from __future__ import annotations

import numpy as np

from treepo_ray.algo.informativeness import (
    DEAD_WRONG,
    REGIMES,
    classify_tree,
    informativeness_weights,
    tree_informativeness,
)
from treepo_ray.tree.tree import Tree


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


def sampled_tokens(trees: list[Tree]) -> int:
    """Tokens generated for these trees: every sampled segment plus the healing's critiques and continuations
    (grafted segments are counted once, as part of the healing's generated tokens, before truncation)."""
    total = 0
    for t in trees:
        grafted = set(t.meta.get("grafted", []))
        total += sum(len(t.tokens[n]) for n in range(1, len(t)) if n not in grafted)
        total += t.meta.get("catpo", {}).get("heal", {}).get("generated_tokens", 0)
    return total


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
