"""Sampling of the hf engine: counter-based seeded uniforms and temperature / top-k / top-p sampling.

Temperature (0 = greedy), then top-k, then top-p on the top-k-renormalised distribution; the token is drawn by
inverse CDF with one uniform number per token that is a hash of (child seed, token index), so a child's tokens
depend only on its own seed and logits, never on what else is in the batch. Reported log-probs are of the sampled
token under the model's distribution at the row's sampling temperature (before top-k and top-p; temperature 1 for
greedy rows): what the learner computes with learner.temperature, so they serve as behaviour log-probs. Entropies,
when asked for, are of that same distribution.
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


_M64 = (1 << 64) - 1
_SMALL = 32
"""Below this many draws, plain Python integers beat numpy's per-call overhead (same bits either way)."""


def _mix64_int(x: int) -> int:
    """_mix64 on one Python int (wrapped to 64 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniforms(seeds: list[int], counters: list[int]) -> np.ndarray:
    """One uniform number in [0, 1) per (seed, counter): a counter-based random stream per sequence."""
    if len(seeds) < _SMALL:
        return np.array([(_mix64_int(_mix64_int(seed & _M64) ^ _mix64_int((c + 0x632BE59BD9B4E019) & _M64)) >> 11)
                         * (1.0 / (1 << 53)) for seed, c in zip(seeds, counters)], dtype=np.float64)
    s = np.array([seed & 0xFFFFFFFFFFFFFFFF for seed in seeds], dtype=np.uint64)
    c = np.array(counters, dtype=np.uint64)
    bits = _mix64(_mix64(s) ^ _mix64(c + _U64(0x632BE59BD9B4E019)))
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


KINDS = ("greedy", "unit", "plain", "mixed")
"""What a batch's rows ask of the sampler, known to the caller without looking at tensors: 'greedy' (every row at
temperature 0), 'unit' (every row at temperature 1, no top-k / top-p), 'plain' (every row at a temperature > 0,
no top-k / top-p) or 'mixed' (anything else). The fast paths compute exactly what the general one does."""


def kind_of(temperature: float, top_k: int, top_p: float) -> str:
    """The sampler kind of one row's parameters."""
    if temperature == 0:
        return "greedy"
    if top_k > 0 or top_p < 1:
        return "mixed"
    return "unit" if temperature == 1 else "plain"


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    u: torch.Tensor,
    kind: str = "mixed",
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draw one token per row of `logits` [N, V]; return (tokens, their log-probs at the row's temperature, and with
    `entropy` the entropy of each row's distribution at that temperature, else None).

    Per row: temperature 0 is greedy; otherwise softmax(logits / temperature), restricted to the top_k most likely
    tokens (0 = all), then to the smallest set of them whose mass reaches top_p, renormalised; the token is the
    inverse CDF at `u` (uniform in [0, 1)). `kind` (KINDS) lets the common batches skip work: 'greedy' and 'unit'
    need none of the parameter tensors, 'plain' only `temperature`.
    """
    logits = logits.float()
    if kind in ("greedy", "unit"):
        z = logits  # temperature 0 rows score their token at temperature 1, as in the general path
    else:
        t = temperature if kind == "plain" else torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        z = logits / t[:, None]
    logp = torch.log_softmax(z, dim=-1)
    if kind == "greedy":
        tokens = logits.argmax(dim=-1)
    elif kind in ("unit", "plain"):
        cdf = torch.softmax(z, dim=-1).cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens = pick.clamp_(max=z.shape[-1] - 1)
    else:
        tokens = _sample_mixed(logits, temperature, top_k, top_p, u)
    ent = torch.special.entr(logp.exp()).sum(dim=-1) if entropy else None  # entr(0) = 0: no NaN at p = 0
    return tokens, logp.gather(1, tokens[:, None])[:, 0], ent


def _sample_mixed(logits, temperature, top_k, top_p, u) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = logits / t[:, None]
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
    return torch.where(temperature > 0, tokens, greedy)
