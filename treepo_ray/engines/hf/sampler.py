"""Sampling of the hf engine: counter-based seeded uniforms and temperature / top-k / top-p sampling.

Temperature (0 = greedy), then top-k, then top-p on the top-k-renormalised distribution; the token is drawn by
inverse CDF with one uniform number per token that is a hash of (child seed, token index), so a child's tokens
depend only on its own seed and logits, never on what else is in the batch. Reported log-probs are of the sampled
token under the model's distribution at the row's sampling temperature (before top-k and top-p; temperature 1 for
greedy rows): what the learner computes with learner.temperature, so they serve as behaviour log-probs.
"""

from __future__ import annotations

import numpy as np
import torch

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea & Flood 2014): a bijective 64-bit mix; uint64 arithmetic wraps."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def uniforms(seeds: list[int], counters: list[int]) -> np.ndarray:
    """One uniform number in [0, 1) per (seed, counter): a counter-based random stream per sequence."""
    s = np.array([seed & 0xFFFFFFFFFFFFFFFF for seed in seeds], dtype=np.uint64)
    c = np.array(counters, dtype=np.uint64)
    bits = _mix64(_mix64(s) ^ _mix64(c + _U64(0x632BE59BD9B4E019)))
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [N, V]; return (tokens, their log-probs at the row's temperature).

    Per row: temperature 0 is greedy; otherwise softmax(logits / temperature), restricted to the top_k most likely
    tokens (0 = all), then to the smallest set of them whose mass reaches top_p, renormalised; the token is the
    inverse CDF at `u` (uniform in [0, 1)).
    """
    logits = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = logits / t[:, None]
    logp = torch.log_softmax(z, dim=-1)
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        tokens = greedy
    else:
        V = z.shape[-1]
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            z, order = z.sort(dim=-1, descending=True)
            probs = torch.softmax(z, dim=-1)
            ranks = torch.arange(V, device=z.device)
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
            probs = probs * (ranks[None] < k[:, None])
            probs = probs / probs.sum(dim=-1, keepdim=True)
            # Keep a token while the mass before it is below top_p: the first token is always kept.
            probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p[:, None])
            cdf = probs.cumsum(dim=-1)
            pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
            tokens = order.gather(1, pick[:, None])[:, 0]
        else:
            cdf = torch.softmax(z, dim=-1).cumsum(dim=-1)
            tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
        tokens = torch.where(temperature > 0, tokens, greedy)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
