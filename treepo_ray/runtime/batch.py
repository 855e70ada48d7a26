"""From scored trees to training samples: each algorithm's credit assignment, the DAPO filter, batch statistics.

Plain Python (no Ray): the pipeline calls these between verification and the learner. Every algorithm starts from
trees whose trajectory rewards are set (Tree.set_trajectory_rewards); sequential sampling is a tree too (a root
with G chains), so one code path serves all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from treepo_ray.algo import dapo_keep_group, grpo_advantages, treepo_scores, treerpo_advantages, whiten
from treepo_ray.learner.batch import TrainSample
from treepo_ray.runtime.catpo import CatpoConfig
from treepo_ray.tree.tree import FINISH_REASONS, Tree

# Each algorithm's own policy loss (its paper's setting), applied under anything a YAML file or the command line
# sets in learner.loss (see runtime.config.load_config). GRPO: Shao et al. 2024 (PPO clip, per-sequence mean,
# KL to the reference); DAPO: Yu et al. 2025 (clip-higher, token-level mean, no KL), which TreePO adopts;
# TreeRPO/CATPO: PPO clip with a k3 KL of 0.001 (CATPO paper, appendix B).
_PPO_KL = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.001, "kl_estimator": "k3"}
_DAPO = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0}
LOSS_PRESETS = {
    "grpo": {**_PPO_KL, "aggregation": "seq-mean"},
    "dapo": _DAPO, "treepo": _DAPO, "treepo_flat": _DAPO,
    "treerpo": _PPO_KL, "catpo": _PPO_KL,
}

DYNAMIC_SAMPLING_BY_DEFAULT = ("dapo", "treepo", "treepo_flat")

ALGORITHMS = ("grpo", "dapo", "treepo", "treepo_flat", "treerpo", "catpo")
# Which grower config an algorithm samples with.
SAMPLER_OF = {"grpo": "sequential", "dapo": "sequential", "treepo": "treepo", "treepo_flat": "treepo",
              "treerpo": "treerpo", "catpo": "treerpo"}


@dataclass
class AlgoConfig:
    """Which algorithm runs, and its credit-assignment knobs (the loss lives in learner.loss)."""

    name: str = "treepo"
    """grpo | dapo | treepo | treepo_flat (tree sampling, flat GRPO advantage) | treerpo | catpo (TreeRPO trees,
    scored, healed and weighted: runtime/catpo.py)."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop prompts whose trajectories all got the same reward, refill from new prompts.
    None = the algorithm's own: on for dapo, treepo and treepo_flat (TreePO trains with DAPO's protocol; a group
    without signal would only shift the batch whitening), off for grpo and treerpo."""
    oversample: float = 1.0
    """With dynamic sampling: prompts grown per round as a multiple of trainer.prompts_per_step (DAPO/TreePO: 3)."""
    max_extra_rounds: int = 2
    """With dynamic sampling: at most this many extra rounds when too few prompts kept (then train on what is kept)."""
    treepo_weighting: str = "average"
    """TreePO subgroup aggregation: 'average' (paper default) or 'size'."""
    whiten_by_tokens: bool = True
    """TreePO: batch whitening weighted by each trajectory's token count (False = one weight per trajectory)."""
    grpo_scale: bool = True
    """GRPO/DAPO/treepo_flat: divide by the group's std (False = only subtract the mean, Dr. GRPO style)."""
    treerpo_prune_range: float = 0.1
    """TreeRPO: a sibling group takes part only if its reward range reaches this (tau_prune)."""
    loss_preset: bool = True
    """Start learner.loss from the algorithm's own loss (LOSS_PRESETS); keys set in learner.loss by a YAML file or
    the command line still win. False = learner.loss's plain defaults."""
    correct_threshold: float = 1.0
    """A trajectory counts as correct (accuracy metrics) when its reward is at least this."""
    catpo: CatpoConfig = field(default_factory=CatpoConfig)
    """CATPO: informativeness thresholds, healing, loss weights (used when name = catpo)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name = {self.name!r}; choose one of {ALGORITHMS}")
        if self.oversample < 1.0:
            raise ValueError(f"algo.oversample = {self.oversample}; it must be >= 1")
        if self.max_extra_rounds < 0:
            raise ValueError(f"algo.max_extra_rounds = {self.max_extra_rounds}; it must be >= 0")

    @property
    def sampler(self) -> str:
        return SAMPLER_OF[self.name]

    @property
    def filters_groups(self) -> bool:
        """Whether DAPO dynamic sampling is on (dynamic_sampling, or the algorithm's default when None)."""
        if self.dynamic_sampling is None:
            return self.name in DYNAMIC_SAMPLING_BY_DEFAULT
        return self.dynamic_sampling


def trajectory_rewards(tree: Tree) -> np.ndarray:
    r = np.array([tree.reward[n] for n in tree.trajectories], dtype=np.float64)
    if np.isnan(r).any():
        raise ValueError(f"tree {tree.query_id!r}: trajectory {int(np.flatnonzero(np.isnan(r))[0])} has no reward")
    return r


def keep_tree(tree: Tree) -> bool:
    """DAPO's filter (eq. 11): a prompt is kept only when its trajectories' rewards are not all equal."""
    return dapo_keep_group(trajectory_rewards(tree))


def build_samples(trees: list[Tree], cfg: AlgoConfig, tree_weights: list[float] | None = None) -> list[TrainSample]:
    """Training samples of a batch of scored trees, one per trajectory, with the algorithm's advantages.

    `tree_weights` (one per tree, default 1) scales every sample of a tree: the place for CATPO's informativeness
    weight. Old log-probs are left None: the learner recomputes them under its current weights (PPO ratio).
    """
    weights = [1.0] * len(trees) if tree_weights is None else list(tree_weights)
    if len(weights) != len(trees):
        raise ValueError(f"{len(weights)} tree weights for {len(trees)} trees")
    samples: list[TrainSample] = []
    if cfg.name == "treepo":
        # TreePO eq. 5 numerator per prompt, then one whitening over the whole batch (weighted by tokens, so the
        # token-mean loss sees zero-mean unit-variance advantages).
        scores, lengths, owners = [], [], []
        for t, tree in enumerate(trees):
            s = treepo_scores(tree.trajectory_paths(), trajectory_rewards(tree), weighting=cfg.treepo_weighting)
            scores.extend(s)
            lengths.extend(len(tree.response_ids(n)) for n in tree.trajectories)
            owners.extend((t, n) for n in tree.trajectories)
        if not scores:
            return []
        adv = whiten(scores, weights=lengths if cfg.whiten_by_tokens else None)
        for a, (t, node) in zip(adv, owners):
            samples.append(_sample(trees[t], node, float(a), weights[t]))
        return samples
    for tree, w in zip(trees, weights):
        if cfg.name in ("treerpo", "catpo"):  # CATPO's credit is TreeRPO's; its weights come in `tree_weights`
            samples.extend(_treerpo_samples(tree, cfg, w))
        else:  # grpo, dapo, treepo_flat: one flat group per prompt (Shao et al. 2024)
            adv = grpo_advantages(trajectory_rewards(tree), scale=cfg.grpo_scale)
            samples.extend(_sample(tree, n, float(a), w) for n, a in zip(tree.trajectories, adv))
    return samples


def _sample(tree: Tree, node: int, advantage: float | list[float], weight: float) -> TrainSample:
    return TrainSample(prompt_ids=list(tree.prompt_ids), response_ids=tree.response_ids(node),
                       advantages=advantage, weight=weight)


def _treerpo_samples(tree: Tree, cfg: AlgoConfig, weight: float) -> list[TrainSample]:
    """TreeRPO credit: every token of a node's segment gets that node's sibling-relative advantage (0 if masked)."""
    rewards = np.array(tree.reward, dtype=np.float64)
    on_path = sorted({n for p in tree.trajectory_paths() for n in p} | {0})
    if np.isnan(rewards[on_path]).any():
        raise ValueError(f"tree {tree.query_id!r}: a node on a trajectory has no propagated reward")
    rewards = np.nan_to_num(rewards, nan=0.0)  # nodes off every trajectory are never trained
    adv, mask = treerpo_advantages(tree.parent, rewards, prune_range=cfg.treerpo_prune_range)
    node_adv = np.where(mask, adv, 0.0)
    out = []
    for node in tree.trajectories:
        per_token = [float(node_adv[n]) for n in tree.path(node) for _ in tree.tokens[n]]
        if per_token:
            out.append(_sample(tree, node, per_token, weight))
    return out


def tree_metrics(trees: list[Tree], correct_threshold: float = 1.0) -> dict:
    """Rollout and tree statistics of a batch (reward, accuracy, lengths, depth, branching, early stops, sharing)."""
    if not trees:
        return {}
    rewards = np.concatenate([trajectory_rewards(t) for t in trees]) if trees else np.zeros(0)
    lengths = [len(t.response_ids(n)) for t in trees for n in t.trajectories]
    # Tokens of the distinct nodes on trajectories: what was generated for them with a perfect prefix cache.
    generated = sum(sum(len(t.tokens[n]) for n in {n for p in t.trajectory_paths() for n in p}) for t in trees)
    path_tokens = sum(lengths)
    out = {
        "rollout/reward": float(rewards.mean()) if rewards.size else math.nan,
        "rollout/accuracy": float((rewards >= correct_threshold).mean()) if rewards.size else math.nan,
        "rollout/response_len": float(np.mean(lengths)) if lengths else math.nan,
        "rollout/trajectories": float(len(lengths)),
        "rollout/prompts": float(len(trees)),
        "rollout/mixed_groups": float(np.mean([keep_tree(t) for t in trees])),
        "tree/nodes": float(np.mean([len(t) for t in trees])),
        "tree/depth_max": float(max(max(t.depth) for t in trees)),
        "tree/depth_mean": float(np.mean([max(t.depth) for t in trees])),
        # Share of trajectory tokens that were not generated separately because a prefix was shared.
        "tree/shared_prefix_share": 1.0 - generated / path_tokens if path_tokens else 0.0,
        "tree/unique_tokens": float(sum(t.unique_tokens() for t in trees)),
    }
    growth = [t.meta.get("growth", {}) for t in trees]
    for key in ("branches", "fallbacks", "surplus_dropped"):
        out[f"tree/{key}"] = float(np.mean([g.get(key, 0) for g in growth]))
    for reason in FINISH_REASONS[1:]:
        out[f"tree/stop_{reason}"] = float(sum(g.get(f"finish/{reason}", 0) for g in growth))
    return out
