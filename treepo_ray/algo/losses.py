"""Policy-gradient losses on token log-probs: PPO clipped surrogate with DAPO clip-higher, dual-clip, KL, entropy.

Shapes: logprobs, old_logprobs, ref_logprobs, entropy and mask are [B, T] float tensors (mask 1 on response
tokens, 0 on prompt/padding); advantages are [B] (one per sequence, broadcast over its tokens) or [B, T].
Only shapes and the config are checked here (a NaN check would force a device sync on every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean")
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
    """"token-mean" (DAPO: every response token of the batch counts once) or "seq-mean" (GRPO: mean per
    sequence, then over sequences)."""
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
    raise ValueError(f"mode = {mode!r}; choose one of {AGGREGATIONS}")


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
