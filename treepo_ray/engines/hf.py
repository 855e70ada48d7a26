"""The embedded default engine: a transformers causal LM behind a tree-aware KV cache, CPU or GPU.

How it runs (see DESIGN.md, "Measured here"):

- Its own forward over the HF model's weights (Llama / Qwen2 / Mistral family: embedding, RMSNorm, rotary,
  q/k/v/o projections with optional biases, SwiGLU MLP, tied or untied lm_head), fused into one q|k|v and one
  gate|up matmul per layer. The HF modules' parameters become views into the fused tensors, so
  `load_weights` (a plain `load_state_dict`) updates both.
- One preallocated KV buffer `[layers, 2, rows, kv_heads, T, head_dim]`: each running sequence owns a row, writes
  its new key/value in place and attends over a view up to the batch's current length (SDPA with native GQA and
  an additive mask for the shorter rows). Running rows are kept contiguous, so no step gathers KV.
- A request's `n` children share the prefix: the prefix (or only its last, not yet fed token, when the parent's
  cache is known) is run once in a "leader" row, the n first tokens are sampled from its logits, and the leader's
  row is copied into n-1 new rows (one indexed copy for all forks of a step).
- Every finished child leaves its own segment's KV rows behind as a cache entry that points at its parent's
  entry (a chain: the tree's KV is stored once, not once per path). A request naming that entry copies the chain
  into its leader row and feeds only the parent's last token, which was sampled but never run through the model.
- Entries are freed by `release`, and the cache is capped: least recently used entries without cached children
  are evicted; a request naming an evicted key recomputes the missing part from `prefix_ids`.

Sampling: temperature (0 = greedy), then top-k, then top-p on the top-k-renormalised distribution; the token is
drawn by inverse CDF with one uniform number per token that is a hash of (child seed, token index), so a child's
tokens depend only on its own seed and logits, never on what else is in the batch (child j of a request uses
seed + j). Reported log-probs are of the sampled token under the temperature-1 model distribution (before
temperature, top-k and top-p), over the tokenizer's vocabulary: logits of padded embedding rows are dropped.
"""

from __future__ import annotations

import copy
import random
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from treepo_ray.engines.base import Segment, SegmentRequest, SegmentResult

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn")


# ----------------------------------------------------------------------------------------------------------------
# Model: a batched forward over a preallocated KV buffer
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store the linears as one transposed weight [in, sum of outs] (plus bias); their parameters become views.

    `x @ W_t` with a contiguous [in, out] weight is up to ~1.7x faster on CPU than `F.linear(x, W)` at the small
    batch sizes of a tree's first segments (measured: 16 x 512 @ 512 x 3072, MKL, one thread).
    """
    weight_t = torch.cat([m.weight.detach() for m in linears]).t().contiguous()
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse projections where only some have a bias")
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    offset = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight_t[:, offset : offset + rows].t()
        if bias is not None:
            m.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight_t, bias


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] @ weight_t [in, out] (+ bias)."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class _Decoder:
    """The decoder stack of a Llama-family model, run over rows of a shared KV buffer."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"HFEngine supports model_type {SUPPORTED_MODEL_TYPES}, not {cfg.model_type!r}; "
                "use another engine for this architecture"
            )
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"HFEngine supports the SwiGLU MLP (hidden_act 'silu'), not {cfg.hidden_act!r}")
        rotary = model.model.rotary_emb
        if rotary.rope_type not in _POSITION_ONLY_ROPE:
            raise ValueError(
                f"HFEngine supports rope types {_POSITION_ONLY_ROPE}, not {rotary.rope_type!r} "
                "(its frequencies depend on the sequence length)"
            )
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.vocab_size = vocab_size
        self.max_positions = cfg.max_position_embeddings
        # A sliding window only matters once a sequence outgrows it; the engine refuses such sequences.
        layer_types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        if window is not None and (cfg.model_type == "mistral" or "sliding_attention" in layer_types):
            self.max_positions = min(self.max_positions, int(window))

        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            wqkv, bqkv = _fuse([att.q_proj, att.k_proj, att.v_proj])
            wgu, bgu = _fuse([mlp.gate_proj, mlp.up_proj])
            wo, bo = _fuse([att.o_proj])
            wd, bd = _fuse([mlp.down_proj])
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    wqkv=wqkv,
                    bqkv=bqkv,
                    wo=wo,
                    bo=bo,
                    ln2=layer.post_attention_layernorm.weight,
                    wgu=wgu,
                    bgu=bgu,
                    wd=wd,
                    bd=bd,
                )
            )
        # Rotary table for every position, from the model's own rotary module (so rope scaling is exactly HF's).
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): fold the sign into the table.
        device = self.embed.device
        positions = torch.arange(self.max_positions + 1, device=device)[None]  # + the padding slot (HFEngine._run)
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=device), positions)
        half = self.head_dim // 2
        self.cos = cos[0].to(self.embed.dtype)
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).to(self.embed.dtype)

    def new_buffer(self, rows: int, length: int) -> torch.Tensor:
        # Zeros, not empty: masked positions are still multiplied (by a zero weight), and stale memory may hold NaN.
        shape = (len(self.layers), 2, rows, self.n_kv, length, self.head_dim)
        return torch.zeros(shape, dtype=self.embed.dtype, device=self.embed.device)

    def forward(
        self,
        kv: torch.Tensor,
        row0: int,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        last: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run `ids` [B, Q] at positions `pos` [B, Q] in KV rows row0..row0+B; return logits [B, vocab].

        `mask` [B, 1, Q, T] is additive (0 or -inf) over the first T positions of each row; `last` [B] picks the
        query position whose logits are returned (None: the last one).
        """
        B, Q = ids.shape
        H, KV, hd, half = self.n_heads, self.n_kv, self.head_dim, self.head_dim // 2
        T = mask.shape[-1]
        rows = torch.arange(row0, row0 + B, device=ids.device)[:, None].expand(B, Q)
        cos = self.cos[pos].unsqueeze(2)
        sin = self.sin[pos].unsqueeze(2)
        D = self.hidden
        x = F.embedding(ids.reshape(-1), self.embed)  # [B*Q, D]: every linear is one 2-D matmul
        for i, ly in enumerate(self.layers):
            h = F.rms_norm(x, (D,), ly.ln1, self.eps)
            qkv = _linear(h, ly.wqkv, ly.bqkv).view(B, Q, H + 2 * KV, hd)
            qk = qkv[:, :, : H + KV]
            qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin
            keys, values = kv[i, 0], kv[i, 1]
            keys[rows, :, pos] = qk[:, :, H:]
            values[rows, :, pos] = qkv[:, :, H + KV :]
            k_view, v_view = keys[row0 : row0 + B, :, :T], values[row0 : row0 + B, :, :T]
            if Q == 1:
                # Decode: the query heads that share a KV head are passed as that head's query positions (all
                # may see every position the mask allows), so SDPA reads each KV row once for all of them
                # (measured ~3x faster on CPU than its GQA path for one query, ~1.2x than two matmuls).
                q = qk[:, 0, :H].reshape(B, KV, H // KV, hd)
                att = F.scaled_dot_product_attention(q, k_view, v_view, attn_mask=mask).reshape(B, H * hd)
            else:
                att = F.scaled_dot_product_attention(
                    qk[:, :, :H].transpose(1, 2), k_view, v_view, attn_mask=mask, enable_gqa=True
                ).transpose(1, 2).reshape(B * Q, H * hd)
            x = x + _linear(att, ly.wo, ly.bo)
            h = F.rms_norm(x, (D,), ly.ln2, self.eps)
            gate, up = _linear(h, ly.wgu, ly.bgu).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, ly.wd, ly.bd)
        x = x.view(B, Q, D)
        x = x[:, -1] if last is None else x[torch.arange(B, device=x.device), last]
        x = F.rms_norm(x, (D,), self.norm, self.eps)
        return F.linear(x, self.lm_head[: self.vocab_size])


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------

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
    """Draw one token per row of `logits` [N, V]; return (tokens, their temperature-1 log-probs).

    Per row: temperature 0 is greedy; otherwise softmax(logits / temperature), restricted to the top_k most likely
    tokens (0 = all), then to the smallest set of them whose mass reaches top_p, renormalised; the token is the
    inverse CDF at `u` (uniform in [0, 1)).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        tokens = greedy
    else:
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
        tokens = torch.where(temperature > 0, tokens, greedy)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------------------------
# Cache entries and running sequences
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    """KV rows [start, end) of one node's positions; the positions before `start` live in the parent's chain."""

    key: str
    parent: str | None
    start: int
    end: int
    kv: torch.Tensor
    tokens: tuple[int, ...]
    """The tokens fed at positions start..end-1 (checked against a request's prefix)."""
    held: bool
    """The caller holds the key (it was returned in a Segment) and has not released it."""
    children: int = 0
    """Entries (and running children) that chain to this one: it cannot be evicted while > 0."""


@dataclass
class _Tomb:
    """What is left of an evicted entry the caller still holds: enough to find its cached ancestors."""

    parent: str | None
    start: int
    end: int


@dataclass
class _Req:
    req: SegmentRequest
    cached: int
    """Positions copied from the cache into the leader row."""
    base: str | None
    """Entry the children's entries chain to (existing, or created after the leader's pass)."""
    new_base: tuple[str, str | None, bool] | None
    """(key, parent key, held) of the entry to create for positions [cached, P-1) after the leader's pass."""
    seeds: list[int]
    version: int
    need: int
    """Buffer positions one child may use: len(prefix) + max_new_tokens."""
    children: list[Segment | None] = field(default_factory=list)
    left: int = 0


@dataclass
class _Row:
    req: _Req
    child: int
    """Child index, or -1 for the leader row that runs the prefix before the children fork."""
    pos: int
    """Positions already written to this row's KV (the next token is fed at this position)."""
    feed: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


_COUNTERS = (
    "forward_tokens",
    "prefill_tokens",
    "decode_tokens",
    "decode_steps",
    "requests",
    "cache_hits",
    "cached_tokens",
    "evictions",
    "recomputed_tokens",
    "uncached_segments",
)
_TIMERS = ("admit", "prefill", "decode", "sample", "branch", "bookkeeping")


class HFEngine:
    """Continuous-batching tree engine over a Llama-family transformers model (see the module docstring)."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_cache_tokens: int = 1 << 18,
        max_batch_size: int = 256,
        max_batch_tokens: int = 1 << 19,
        vocab_size: int | None = None,
        eos_token_id: int | list[int] | None = None,
        seed: int = 0,
        num_threads: int | None = None,
    ):
        """`model`: an HF model directory or a loaded causal LM. `max_cache_tokens`: cap on the positions kept in
        node caches. `max_batch_size`: running sequences at once. `max_batch_tokens`: cap on the sum over running
        sequences of (prefix + max_new_tokens), which bounds the KV buffer. `vocab_size`: the tokenizer's size
        (default: read from the model directory's tokenizer, else the config's). `seed`: seeds of requests that
        give none."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        for name, value in (("max_cache_tokens", max_cache_tokens), ("max_batch_size", max_batch_size),
                            ("max_batch_tokens", max_batch_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if isinstance(model, (str, Path)):
            model, vocab_size, eos_token_id = _load(Path(model), dtype, vocab_size, eos_token_id)
        model = model.to(device=device, dtype=dtype).eval()
        cfg = model.config
        if vocab_size is None:
            vocab_size = cfg.vocab_size
        if eos_token_id is None:
            eos_token_id = cfg.eos_token_id
        if eos_token_id is None:
            raise ValueError("the model config names no eos_token_id; pass eos_token_id=")
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_id: int = eos[0]
        self._eos = set(eos)
        self.model = model
        self.device = torch.device(device)
        self._net = _Decoder(model, min(vocab_size, cfg.vocab_size))
        self.vocab_size = self._net.vocab_size
        self.max_cache_tokens = max_cache_tokens
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.weights_version = 0
        self._seed = seed
        self._init_state()

    def _init_state(self) -> None:
        """Everything but the model and the settings: batch, caches, counters."""
        self._rng = random.Random(self._seed)
        self._tag = uuid.uuid4().hex[:8]
        self._next_key = 0
        self._kv = self._net.new_buffer(0, 0)
        self._pending: deque[SegmentRequest] = deque()
        self._rows: list[_Row] = []
        self._reserved_tokens = 0
        self._done: list[SegmentResult] = []
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tombs: dict[str, _Tomb] = {}
        self._prompts: dict[tuple[int, ...], str] = {}
        self._cache_tokens = 0
        self._ids: set[str] = set()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._times = dict.fromkeys(_TIMERS, 0.0)

    def fork(self) -> HFEngine:
        """Another engine on the same weights (shared, not copied) with its own batch, caches and counters (e.g.
        to time two workloads side by side). `load_weights` on either changes both models' weights."""
        other = copy.copy(self)
        other._init_state()
        return other

    # ------------------------------------------------------------------------------------------------ protocol

    def add_requests(self, requests: list[SegmentRequest]) -> None:
        """Queue requests (checked first, all or none); they join the running batch at the next step."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids repeat within one add_requests call: {sorted(ids)[:5]}...")
        for r in requests:
            self._check(r)
        for r in requests:
            self._ids.add(r.request_id)
            self._pending.append(r)

    def has_unfinished(self) -> bool:
        return bool(self._pending or self._rows or self._done)

    def step(self) -> list[SegmentResult]:
        with torch.inference_mode():
            t = time.perf_counter()
            self._admit()
            t = self._tick("admit", t)
            if self._rows:
                self._run(t)
        done, self._done = self._done, []
        for res in done:
            self._ids.discard(res.request_id)
        return done

    def release(self, keys: list[str]) -> None:
        for key in keys:
            if key in self._tombs:
                del self._tombs[key]
            entry = self._entries.get(key)
            if entry is not None and entry.held:
                entry.held = False
                self._maybe_free(entry)

    def stats(self) -> dict:
        out: dict = dict(self._stats)
        out["cache_entries"] = len(self._entries)
        out["cache_tokens"] = self._cache_tokens
        out["running"] = len(self._rows)
        out["pending"] = len(self._pending)
        out["weights_version"] = self.weights_version
        out.update({f"time_{k}_s": v for k, v in self._times.items()})
        return out

    def reset_stats(self) -> None:
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._times = dict.fromkeys(_TIMERS, 0.0)

    def time_decode_step(self, rows: int, length: int, repeats: int = 5) -> float:
        """Median seconds of one decode forward of `rows` sequences at position `length` (on a scratch buffer):
        what the per-step fixed cost and the attention share are made of."""
        if rows < 1 or not 1 <= length <= self._net.max_positions:
            raise ValueError(f"rows must be >= 1 and length in [1, {self._net.max_positions}]")
        kv = self._net.new_buffer(rows, length)
        ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        pos = torch.full((rows, 1), length - 1, device=self.device)
        mask = torch.zeros(rows, 1, 1, length, dtype=kv.dtype, device=self.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                start = time.perf_counter()
                self._net.forward(kv, 0, ids, pos, mask, None)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        return sorted(times[1:])[repeats // 2]

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Copy `state_dict` (HF parameter names) into the model in place and drop every cache entry (its KV was
        computed by the old weights). Requests still waiting are admitted with the new weights; running ones
        must finish first."""
        if self._rows:
            raise RuntimeError(f"load_weights while {len(self._rows)} sequences are running; let them finish first")
        own = dict(self.model.named_parameters())
        tied = {n for n in own if n == "lm_head.weight" and own[n] is self.model.get_input_embeddings().weight}
        unknown = sorted(set(state_dict) - set(self.model.state_dict()))
        missing = sorted(set(own) - set(state_dict) - tied)
        if unknown or missing:
            raise ValueError(f"load_weights: unknown keys {unknown[:5]}, missing keys {missing[:5]}")
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
        self.weights_version = int(version)
        self._entries.clear()
        self._tombs.clear()
        self._prompts.clear()
        self._cache_tokens = 0

    # ------------------------------------------------------------------------------------------------ planning

    def _check(self, r: SegmentRequest) -> None:
        where = f"request {r.request_id!r}"
        if r.request_id in self._ids:
            raise ValueError(f"{where}: request_id is already in use")
        if not r.prefix_ids:
            raise ValueError(f"{where}: prefix_ids is empty")
        if r.n < 1 or r.max_new_tokens < 1:
            raise ValueError(f"{where}: n ({r.n}) and max_new_tokens ({r.max_new_tokens}) must be >= 1")
        p = r.params
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            raise ValueError(f"{where}: bad sampling params {p}")
        bad = [t for t in r.prefix_ids if not 0 <= t < self._net.embed.shape[0]]
        if bad:
            raise ValueError(f"{where}: prefix token ids {bad[:5]} are outside the embedding")
        need = len(r.prefix_ids) + r.max_new_tokens
        if need > self._net.max_positions:
            raise ValueError(f"{where}: prefix + max_new_tokens = {need} > the model's {self._net.max_positions}")
        if r.n > self.max_batch_size or r.n * need > self.max_batch_tokens:
            raise ValueError(
                f"{where}: {r.n} children of up to {need} positions cannot fit max_batch_size={self.max_batch_size}"
                f" / max_batch_tokens={self.max_batch_tokens}"
            )
        entry = self._entries.get(r.parent_key) if r.parent_key is not None else None
        tomb = self._tombs.get(r.parent_key) if r.parent_key is not None else None
        if (entry is not None and (entry.end != need - r.max_new_tokens - 1
                                   or tuple(r.prefix_ids[entry.start : entry.end]) != entry.tokens)) or (
                tomb is not None and tomb.end != need - r.max_new_tokens - 1):
            raise ValueError(f"{where}: prefix_ids do not end at cached node {r.parent_key!r}")
        if need > self.max_cache_tokens:
            raise ValueError(f"{where}: a path of {need} positions cannot fit max_cache_tokens={self.max_cache_tokens}")

    def _plan(self, r: SegmentRequest) -> _Req:
        """Find what the cache holds of this prefix; fix the children's seeds."""
        P = len(r.prefix_ids)
        base, new_base, cached = None, None, 0
        key = r.parent_key
        entry = self._entries.get(key) if key is not None else None
        if entry is not None:  # _check made sure the prefix ends at this entry
            base, cached = key, P - 1
        elif key is not None and key in self._tombs:
            # Evicted: find the deepest ancestor still cached and recompute the rest as a revived entry.
            anc: str | None = key
            while anc is not None and anc not in self._entries:
                anc = self._tombs[anc].parent if anc in self._tombs else None
            cached = self._entries[anc].end if anc is not None else 0
            new_base = (key, anc, True)
        elif P > 1:
            prompt = self._prompts.get(tuple(r.prefix_ids[: P - 1]))
            if prompt is not None:
                base, cached = prompt, P - 1
            else:
                new_base = (self._new_key(), None, False)
        if key is not None and entry is None:
            self._stats["recomputed_tokens"] += P - 1 - cached
        if base is not None:
            self._stats["cache_hits"] += 1
        self._stats["cached_tokens"] += cached
        self._stats["requests"] += 1
        if base is not None:
            self._entries[base].children += r.n  # pinned until the children's own entries exist
        seed = r.params.seed if r.params.seed is not None else self._rng.getrandbits(63)
        req = _Req(r, cached, base, new_base, [seed + j for j in range(r.n)], self.weights_version,
                   P + r.max_new_tokens)
        req.children, req.left = [None] * r.n, r.n
        if new_base is not None and new_base[1] is not None:
            self._entries[new_base[1]].children += 1  # the revived entry will chain to this ancestor
        return req

    def _chain(self, key: str | None) -> list[_Entry]:
        out = []
        while key is not None:
            e = self._entries[key]
            self._entries.move_to_end(key)
            out.append(e)
            key = e.parent
        return out[::-1]

    # ------------------------------------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Move pending requests into leader rows while the batch limits allow (first come, first served)."""
        rows = len(self._rows)
        admitted: list[_Req] = []
        while self._pending:
            r = self._pending[0]
            need = len(r.prefix_ids) + r.max_new_tokens
            if rows + r.n > self.max_batch_size or self._reserved_tokens + r.n * need > self.max_batch_tokens:
                break
            self._pending.popleft()
            rows += r.n
            self._reserved_tokens += r.n * need
            admitted.append(self._plan(r))
        if not admitted:
            return
        # Leaders that feed one token join the decode pass; those that feed more form the prefill pass (last).
        admitted.sort(key=lambda q: len(q.req.prefix_ids) - q.cached > 1)
        # One spare position at the end takes the prefill pass's padding (see _run).
        self._ensure(rows, 1 + max([q.need for q in admitted] + [r.req.need for r in self._rows]))
        for q in admitted:
            row = len(self._rows)
            anchor = q.base if q.base is not None else (q.new_base[1] if q.new_base else None)
            for e in self._chain(anchor):
                self._kv[:, :, row, :, e.start : e.end] = e.kv
            self._rows.append(_Row(q, -1, q.cached, list(q.req.prefix_ids[q.cached :])))

    def _ensure(self, rows: int, length: int) -> None:
        """Grow the KV buffer to at least `rows` x `length` positions (geometrically, keeping live rows)."""
        have_rows, have_len = self._kv.shape[2], self._kv.shape[4]
        if rows <= have_rows and length <= have_len:
            return
        new_rows = max(rows, min(self.max_batch_size, have_rows * 2)) if rows > have_rows else have_rows
        new_len = max(length, have_len * 3 // 2) if length > have_len else have_len
        new_len = min(self._net.max_positions + 1, -(-new_len // 64) * 64)
        kv = self._net.new_buffer(new_rows, new_len)
        live = len(self._rows)
        if live:
            kv[:, :, :live, :, :have_len] = self._kv[:, :, :live]
        self._kv = kv

    # ------------------------------------------------------------------------------------------------ one step

    def _tick(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self._times[phase] += now - since
        return now

    def _run(self, t: float) -> None:
        rows = self._rows
        B = len(rows)
        Bd = next((i for i, r in enumerate(rows) if len(r.feed) > 1), B)
        logits = []
        if Bd:
            pos = [r.pos for r in rows[:Bd]]
            T = max(pos) + 1
            ids = torch.tensor([[r.feed[0]] for r in rows[:Bd]], device=self.device)
            pos_t = torch.tensor(pos, device=self.device)
            mask = self._mask(pos_t[:, None], T)
            logits.append(self._net.forward(self._kv, 0, ids, pos_t[:, None], mask, None))
            self._stats["decode_steps"] += 1
            t = self._tick("decode", t)
        if Bd < B:
            pre = rows[Bd:]
            Q = max(len(r.feed) for r in pre)
            ids = torch.tensor([r.feed + [0] * (Q - len(r.feed)) for r in pre], device=self.device)
            # Padding queries write their (unused) keys into the buffer's last position, which no row uses.
            trash = self._kv.shape[4] - 1
            pos = [[r.pos + j if j < len(r.feed) else trash for j in range(Q)] for r in pre]
            pos_t = torch.tensor(pos, device=self.device)
            mask = self._mask(pos_t, max(r.pos + len(r.feed) for r in pre))
            last = torch.tensor([len(r.feed) - 1 for r in pre], device=self.device)
            logits.append(self._net.forward(self._kv, Bd, ids, pos_t, mask, last))
            t = self._tick("prefill", t)
        fed = [len(r.feed) for r in rows]
        for r, n_fed in zip(rows, fed):
            if r.child < 0:
                self._stats["prefill_tokens"] += n_fed
            else:
                self._stats["decode_tokens"] += 1
        self._stats["forward_tokens"] += sum(fed)

        # Sample: a leader draws one token per child from its logits.
        counts = [r.req.req.n if r.child < 0 else 1 for r in rows]
        seeds, counters, params = [], [], []
        for r, c in zip(rows, counts):
            if r.child < 0:
                seeds.extend(r.req.seeds)
                counters.extend([0] * c)
            else:
                seeds.append(r.req.seeds[r.child])
                counters.append(len(r.tokens))
            params.extend([r.req.req.params] * c)
        all_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        if B != len(seeds):
            all_logits = all_logits.repeat_interleave(torch.tensor(counts, device=self.device), dim=0)
        tokens, logps = sample(
            all_logits,
            torch.tensor([p.temperature for p in params], device=self.device),
            torch.tensor([p.top_k for p in params], device=self.device),
            torch.tensor([p.top_p for p in params], device=self.device),
            torch.from_numpy(uniforms(seeds, counters)).to(self.device, torch.float32),
        )
        tokens, logps = tokens.tolist(), logps.tolist()
        t = self._tick("sample", t)

        # Advance rows; fork leaders into their children (child 0 keeps the leader's row).
        src, dst, finished = [], [], []
        k = 0
        for i in range(B):
            r = rows[i]
            r.pos += fed[i]
            if r.child < 0:
                q = r.req
                self._make_base(q, i)
                for j in range(q.req.n):
                    row = _Row(q, j, r.pos, [])
                    if j == 0:
                        rows[i] = row
                    else:
                        src.append(i)
                        dst.append(len(rows))
                        rows.append(row)
                    self._append(row, tokens[k + j], logps[k + j], finished, i if j == 0 else len(rows) - 1)
                k += q.req.n
            else:
                self._append(r, tokens[k], logps[k], finished, i)
                k += 1
        t = self._tick("bookkeeping", t)
        if src:
            T = max(rows[i].pos for i in src)
            d = torch.tensor(dst, device=self.device)
            self._kv[:, :, d, :, :T] = self._kv[:, :, torch.tensor(src, device=self.device), :, :T]
        if finished:
            for i in finished:
                self._finish(rows[i], i)
            self._compact(set(finished))
        self._tick("branch", t)

    def _mask(self, pos: torch.Tensor, T: int) -> torch.Tensor:
        """Additive attention mask [B, 1, Q, T]: query at position p sees positions <= p."""
        see = torch.arange(T, device=self.device)[None, None, :] <= pos[:, :, None]
        zero = torch.zeros((), dtype=self._kv.dtype, device=self.device)
        return torch.where(see, zero, torch.tensor(float("-inf"), dtype=self._kv.dtype, device=self.device))[:, None]

    def _append(self, row: _Row, token: int, logp: float, finished: list[int], index: int) -> None:
        row.tokens.append(token)
        row.logprobs.append(logp)
        row.feed = [token]
        q = row.req.req
        if len(row.tokens) >= q.max_new_tokens or (q.stop_at_eos and token in self._eos):
            finished.append(index)

    def _make_base(self, q: _Req, row: int) -> None:
        """After the leader's pass: keep positions [cached, P-1) as the entry its children chain to."""
        if q.new_base is None:
            return
        key, parent, held = q.new_base
        held = held and key in self._tombs  # a revived key the caller released meanwhile is not held any more
        P = len(q.req.prefix_ids)
        if P - 1 > q.cached:
            kv = self._kv[:, :, row, :, q.cached : P - 1].clone()
            tokens = tuple(q.req.prefix_ids[q.cached : P - 1])
            self._add_entry(_Entry(key, parent, q.cached, P - 1, kv, tokens, held, children=q.req.n), force=True)
            if not held:
                self._prompts[tuple(q.req.prefix_ids[: P - 1])] = key
            self._tombs.pop(key, None)
            q.base = key
        elif parent is not None:
            self._entries[parent].children += q.req.n - 1  # nothing to revive: children chain to the ancestor
            q.base = parent
            self._tombs.pop(key, None)
        q.new_base = None

    def _finish(self, row: _Row, index: int) -> None:
        """A child is complete: keep its segment's KV rows [P-1, pos) as its cache entry and report it."""
        q = row.req
        P = len(q.req.prefix_ids)
        reason = "eos" if q.req.stop_at_eos and row.tokens[-1] in self._eos else "length"
        seg = Segment(list(row.tokens), list(row.logprobs), reason, None)
        key = self._new_key()
        kv = self._kv[:, :, index, :, P - 1 : row.pos].clone()
        fed = tuple([q.req.prefix_ids[-1]] + row.tokens[:-1])
        if self._add_entry(_Entry(key, q.base, P - 1, row.pos, kv, fed, held=True)):
            seg.cache_key = key
        else:
            self._stats["uncached_segments"] += 1
            if q.base is not None:
                base = self._entries[q.base]
                base.children -= 1
                self._maybe_free(base)
        q.children[row.child] = seg
        self._reserved_tokens -= q.need
        q.left -= 1
        if q.left == 0:
            self._done.append(SegmentResult(q.req.request_id, list(q.children), q.version))

    def _compact(self, finished: set[int]) -> None:
        """Drop finished rows, moving rows from the end into the holes so running rows stay contiguous."""
        rows = self._rows
        keep = len(rows) - len(finished)
        holes = [i for i in sorted(finished) if i < keep]
        movers = [i for i in range(keep, len(rows)) if i not in finished]
        if holes:
            T = max(rows[i].pos for i in movers)
            h = torch.tensor(holes, device=self.device)
            self._kv[:, :, h, :, :T] = self._kv[:, :, torch.tensor(movers, device=self.device), :, :T]
            for i, j in zip(holes, movers):
                rows[i] = rows[j]
        del rows[keep:]

    def _new_key(self) -> str:
        self._next_key += 1
        return f"{self._tag}-{self._next_key}"

    # ------------------------------------------------------------------------------------------------ cache

    def _add_entry(self, entry: _Entry, force: bool = False) -> bool:
        """Insert `entry`, evicting LRU entries to respect max_cache_tokens; False if it cannot be stored."""
        size = entry.end - entry.start
        if not force and not self._make_room(size):
            return False
        self._entries[entry.key] = entry
        self._cache_tokens += size
        if force:
            self._make_room(0)
        return True

    def _make_room(self, size: int) -> bool:
        while self._cache_tokens + size > self.max_cache_tokens:
            victim = next((e for e in self._entries.values() if e.children == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, entry: _Entry) -> None:
        self._stats["evictions"] += 1
        if entry.held:
            self._tombs[entry.key] = _Tomb(entry.parent, entry.start, entry.end)
        self._drop(entry)

    def _maybe_free(self, entry: _Entry) -> None:
        if not entry.held and entry.children == 0:
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._cache_tokens -= entry.end - entry.start
        if self._prompts.get(entry.tokens) == entry.key:
            del self._prompts[entry.tokens]
        if entry.parent is not None:
            parent = self._entries[entry.parent]
            parent.children -= 1
            self._maybe_free(parent)


def _load(path: Path, dtype: torch.dtype, vocab_size: int | None, eos: int | list[int] | None):
    """Load a causal LM from a local directory; read the tokenizer's size and EOS when it has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if vocab_size is None or eos is None:
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tok = None
        if tok is not None:
            vocab_size = vocab_size if vocab_size is not None else len(tok)
            if eos is None:
                gen = getattr(model, "generation_config", None)
                eos = getattr(gen, "eos_token_id", None) or tok.eos_token_id
    return model, vocab_size, eos
