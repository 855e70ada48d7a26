"""Policy-gradient losses on token log-probs: PPO clipped surrogate with DAPO clip-higher, dual-clip, KL, entropy.

Two forms of one objective:
- `policy_loss`: the per-sequence definition on padded [B, T] tensors (mask 1 on response tokens, 0 on
  prompt/padding; advantages [B] or [B, T]) with token-mean or seq-mean aggregation: the reference.
- `tree_policy_loss`: the same terms as a weighted sum over scored tokens, each token once, with per-token weights
  that carry the advantages and normalisers of every trajectory through it (learner/packing.py builds them; the
  learner trains with this form, packed or not). It also takes the decoupled-PPO behaviour weights.
Only shapes and the config are checked here (a NaN check would force a device sync on every step).
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


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar over masked tokens.

    "token-mean": sum(values * mask) / sum(mask). "seq-mean": each sequence's masked mean, then the mean over
    sequences that have at least one token. Returns 0 (still attached to the graph) when no token is masked.
    ("node-mean" needs the tree: see tree_policy_loss.)
    """
    if values.shape != mask.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but values {tuple(values.shape)}")
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean":
        tokens = mask.sum(dim=-1)
        per_seq = (values * mask).sum(dim=-1) / tokens.clamp(min=1.0)
        has_tokens = (tokens > 0).to(values.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"mode = {mode!r}; choose token-mean or seq-mean")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate policy loss plus optional KL and entropy terms, and the figures a trainer logs.

    Per token (PPO, Schulman et al. 2017, with DAPO's asymmetric clip, Yu et al. 2025 eq. 10):
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)),  ratio = exp(logprobs - old)
    and with dual-clip, for A < 0: pg = min(pg, -A * c) (Ye et al. 2020). Then
        loss = agg(pg) + kl_coef * agg(kl_penalty(logprobs, ref)) - entropy_coef * agg(entropy)
    with agg the configured aggregation. Differentiable w.r.t. logprobs and entropy.

    Metrics: "pg_loss", "kl_loss" (0 without ref_logprobs) and "entropy" (0 without entropy) are the aggregated
    terms above, so loss = pg_loss + kl_coef * kl - entropy_coef * entropy. "pg_clipfrac" is the share of
    response tokens whose clipped term is the active one, split into "pg_clipfrac_below" (A < 0, ratio below
    1 - clip_low) and "pg_clipfrac_above" (A > 0, ratio above 1 + clip_high); "pg_clipfrac_lower" the share
    capped by dual-clip; "ppo_kl" the mean of old - new log-probs over response tokens (verl's k1 estimate of
    KL(old || new), so the figure reads as verl's; it can be negative). The names are verl's
    (the pipeline logs them as actor/<name>), below/above are this project's own split of pg_clipfrac.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                    ("entropy", entropy)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("cfg.entropy_coef != 0 needs the per-token entropy")

    mask = mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype).detach()
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    dual_capped = torch.zeros_like(pg, dtype=torch.bool)
    if cfg.dual_clip is not None:
        cap = -advantages * cfg.dual_clip
        dual_capped = (advantages < 0) & (pg > cap)
        pg = torch.where(dual_capped, cap.expand_as(pg), pg)

    pg_loss = aggregate(pg, mask, cfg.aggregation)
    loss = pg_loss
    zero = pg_loss.new_zeros(())
    kl = zero
    if ref_logprobs is not None:
        kl = aggregate(kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator), mask, cfg.aggregation)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    ent = zero
    if entropy is not None:
        ent = aggregate(entropy, mask, cfg.aggregation)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent

    with torch.no_grad():
        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return aggregate(x.to(logprobs.dtype), mask, "token-mean")

        adv = advantages.expand_as(pg)
        clip_low = (adv < 0) & (ratio < 1.0 - cfg.clip_low)
        clip_high = (adv > 0) & (ratio > 1.0 + cfg.clip_high)
        figures = torch.stack([
            pg_loss.detach(), token_mean(clip_low | clip_high), token_mean(clip_low), token_mean(clip_high),
            token_mean(dual_capped), token_mean(-log_ratio), kl.detach(), ent.detach(),
            loss.detach(),
        ]).tolist()  # one device sync for all figures
    names = ("pg_loss", "pg_clipfrac", "pg_clipfrac_below", "pg_clipfrac_above", "pg_clipfrac_lower", "ppo_kl",
             "kl_loss", "entropy", "loss")
    return loss, dict(zip(names, figures))


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
    """policy_loss as a weighted sum over scored tokens; all tensors [N] except `weights` [N, 6].

    Columns of `weights` (learner/packing.py): pos = sum of c * A over the trajectories through the token with
    A > 0, neg = the same over A < 0, weight = sum of c (c: the normaliser of each trajectory's, or node's, token),
    count, n_pos, n_neg (trajectories through it: all, A > 0, A < 0). With r = exp(logprobs - old_logprobs),
        pg = -pos * min(r, 1 + clip_high) - neg * min(max(r, 1 - clip_low), dual_clip)
    is the sum over those trajectories of max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (capped at -A c for
    A < 0 with dual-clip), so it equals policy_loss's terms summed token by token, gradient included. Then
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
        # Names as policy_loss's (verl's): ppo_kl is the mean of old - new log-probs (k1), once divided by count.
        sums = dict(loss=loss.detach(), pg_loss=pg_loss.detach(), kl_loss=kl.detach(), entropy=ent.detach(),
                    count=count.sum(), pg_clipfrac=low + high, pg_clipfrac_below=low, pg_clipfrac_above=high,
                    pg_clipfrac_lower=(n_neg * dual).sum(), ppo_kl=(count * -log_ratio).sum())
    return loss, sums
