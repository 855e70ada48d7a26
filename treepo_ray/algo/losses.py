"""The policy loss every algorithm trains with: PPO's clipped surrogate with DAPO's clip-higher, dual-clip, a KL
penalty to the reference policy and an entropy term, on token log-probs.

Per response token t of trajectory i (advantage A_i, or A_t per token; r = exp(logp - old)):
    pg_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))            (PPO, Schulman et al. 2017; DAPO eq. 10)
           capped at -A c for A < 0 with dual_clip = c                     (Ye et al. 2020)
    loss = agg(pg) + kl_coef agg(kl(logp, ref)) - entropy_coef agg(entropy)
with `agg` the aggregation: token-mean (every response token of the batch once: DAPO, TreePO), seq-mean (each
trajectory's mean, then the mean over trajectories: GRPO), node-mean (each tree node's mean over its tokens, then
the mean over the nodes that take part, with per-node advantages: TreeRPO, CATPO eq. 7). Each algorithm's setting
of these fields is its `loss` (algo/<name>.py).

`tree_policy_loss` computes exactly this as a weighted sum over the distinct tokens of packed trees: a token shared
by several trajectories is scored once, with per-token weights that carry the advantage and the aggregation's
normaliser of every trajectory (or node) through it. Those weights are built by learner/packing.py (`loss_weights`);
the learner trains with this function, packed or not. It also takes the decoupled-PPO behaviour weights. Only shapes
and the config are checked here (a NaN check would force a device sync on every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "node-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class LossConfig:
    """How the policy loss is formed from per-token terms."""

    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low (PPO epsilon)."""
    clip_high: float = 0.28
    """Upper clip range: the ratio is clipped at 1 + clip_high (DAPO clip-higher; equal to clip_low for PPO)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye et al. 2020): for negative advantages the loss is capped at c * |A|."""
    aggregation: str = "token-mean"
    """"token-mean" (DAPO: every response token of the batch counts once), "seq-mean" (GRPO: mean per
    sequence, then over sequences) or "node-mean" (TreeRPO/CATPO, CATPO eq. 7: each tree node once, averaged over
    its own tokens, then over the nodes that take part; needs per-node advantages)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0 disables it; then ref_logprobs may be None)."""
    kl_estimator: str = "k3"
    """KL estimator (Schulman 2020): "k1" log-ratio, "k2" half squared log-ratio, "k3" low-variance."""
    entropy_coef: float = 0.0
    """Entropy weight: loss -= entropy_coef * entropy, so a positive value is a bonus."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low = {self.clip_low}; it must lie in [0, 1)")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high = {self.clip_high}; it must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip = {self.dual_clip}; it must be > 1 (or None to disable)")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation = {self.aggregation!r}; choose one of {AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator = {self.kl_estimator!r}; choose one of {KL_ESTIMATORS}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef = {self.kl_coef}; it must be >= 0")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens (Schulman, "Approximating KL divergence").

    With log r = ref_logprobs - logprobs: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (unbiased and
    always >= 0; the log-ratio is clamped to [-20, 20] first so exp cannot overflow).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, logprobs {tuple(logprobs.shape)}")
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"estimator = {estimator!r}; choose one of {KL_ESTIMATORS}")


# Per-token loss weights of tree_policy_loss, in column order (learner/packing.py: COLUMNS).
W_POS, W_NEG, W_WEIGHT, W_COUNT, W_NPOS, W_NNEG = range(6)

TREE_FIGURES = ("loss", "pg_loss", "kl_loss", "entropy", "count", "pg_clipfrac", "pg_clipfrac_below",
                "pg_clipfrac_above", "pg_clipfrac_lower", "ppo_kl")
"""The additive sums tree_policy_loss returns: the first four are the loss terms themselves (already normalised),
the rest count-weighted sums that become token means once divided by the summed "count"."""


def tree_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    behaviour_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss (module docstring) as a weighted sum over scored tokens; all tensors [N] except `weights`
    [N, 6].

    Columns of `weights` (learner/packing.py): pos = sum of c * A over the trajectories through the token with
    A > 0, neg = the same over A < 0, weight = sum of c (c: the normaliser of each trajectory's, or node's, token),
    count, n_pos, n_neg (trajectories through it: all, A > 0, A < 0). With r = exp(logprobs - old_logprobs),
        pg = -pos * min(r, 1 + clip_high) - neg * min(max(r, 1 - clip_low), dual_clip)
    is the sum over those trajectories of max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (capped at -A c for
    A < 0 with dual-clip), so it equals the per-trajectory terms summed token by token, gradient included. Then
        loss = sum(pg * w_b) + kl_coef * sum(weight * kl) - entropy_coef * sum(weight * entropy)
    with w_b the decoupled-PPO behaviour weight pi_prox / pi_behav of each token (AReaL, Fu et al. 2025; 1 when
    None). Returns the loss and the additive sums of TREE_FIGURES (detached).
    """
    n = logprobs.shape
    if logprobs.dim() != 1 or weights.shape != (n[0], 6):
        raise ValueError(f"logprobs must be [N] and weights [N, 6], got {tuple(n)} and {tuple(weights.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("entropy", entropy),
                    ("behaviour_weight", behaviour_weight)):
        if t is not None and t.shape != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(n)}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("cfg.entropy_coef != 0 needs the per-token entropy")

    w = weights.to(logprobs.dtype)
    pos, neg, weight = w[:, W_POS], w[:, W_NEG], w[:, W_WEIGHT]
    if behaviour_weight is not None:
        b = behaviour_weight.to(logprobs.dtype).detach()
        pos, neg = pos * b, neg * b
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    up = ratio.clamp(max=1.0 + cfg.clip_high)  # A > 0: min(r, clip(r)) = min(r, 1 + clip_high)
    down = ratio.clamp(min=1.0 - cfg.clip_low)  # A < 0: max(r, clip(r)) = max(r, 1 - clip_low)
    dual = torch.zeros_like(ratio, dtype=torch.bool)
    if cfg.dual_clip is not None:
        dual = down > cfg.dual_clip
        down = down.clamp(max=cfg.dual_clip)
    pg_loss = -(pos * up + neg * down).sum()
    loss = pg_loss
    zero = pg_loss.new_zeros(())
    kl = zero
    if ref_logprobs is not None:
        kl = (weight * kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)).sum()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    ent = zero
    if entropy is not None:
        ent = (weight * entropy).sum()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent

    with torch.no_grad():
        count, n_pos, n_neg = w[:, W_COUNT], w[:, W_NPOS], w[:, W_NNEG]
        low = (n_neg * (ratio < 1.0 - cfg.clip_low)).sum()
        high = (n_pos * (ratio > 1.0 + cfg.clip_high)).sum()
        # verl's names: ppo_kl is the mean of old - new log-probs (k1, verl's estimate of KL(old || new), so it can
        # be negative), once divided by count; pg_clipfrac_below/above are this project's split of pg_clipfrac.
        sums = dict(loss=loss.detach(), pg_loss=pg_loss.detach(), kl_loss=kl.detach(), entropy=ent.detach(),
                    count=count.sum(), pg_clipfrac=low + high, pg_clipfrac_below=low, pg_clipfrac_above=high,
                    pg_clipfrac_lower=(n_neg * dual).sum(), ppo_kl=(count * -log_ratio).sum())
    return loss, sums
