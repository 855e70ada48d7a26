"""The hf engine's scheduling: requests, admission into KV rows, the decode loop, counters and weight loads.

- Requests queue until the batch limits let them in (first come, first served). A request's `n` children share the
  prefix: the prefix (or only its last, not yet fed token, when the parent's cache is known) is run once in a
  "leader" row, the n first tokens are sampled from its logits, and the leader's row is copied into n-1 new rows
  (one indexed copy for all forks of a step). Running rows are kept contiguous, so no step gathers KV. A decode
  pass's attention runs in blocks of rows, each reading only as far as its longest row; the rows are sorted longest
  first when rows of very different lengths share the batch (`_order_decode_rows`).
- A request naming a cache entry (cache.py) copies the chain into its leader row and feeds only the parent's last
  token, which was sampled but never run through the model; a request naming an evicted key recomputes the
  missing part from `prefix_ids`. Every finished child leaves its segment's KV behind as a new entry.
- A result says what ran for its request alone (`forward_tokens`: the positions fed for its leader and child rows)
  and names the entry its children chain to (`prefix_key`), a prompt's entry too: a later request from the root (a
  TreePO fallback) names it and continues from it, even after new weights stopped new prompts from reusing
  cached prompts (it recomputed the whole prompt before).
- Child j of a request uses seed + j (sampler.py), so its random draws never depend on the rest of the batch;
  its logits do in their last bits (the batch's shape changes how the kernels sum: log-probs moved by up to
  4.5e-6 between a request run alone and beside 39 others), so a token drawn within that distance of a CDF
  boundary can differ. Measured: none of 1024 children of 256 tokens differed between two batch compositions.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treepo_ray.engines.base import SegmentRequest, SegmentResult
from treepo_ray.engines.hf.cache import Entry, NodeCache
from treepo_ray.engines.hf.model import Decoder, load_model
from treepo_ray.engines.hf.logprobs import teacher_forced_logprobs
from treepo_ray.engines.hf.sampler import kind_of, sample, uniforms
from treepo_ray.tree import Segment


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
    kind: str = "mixed"
    """What its sampling parameters ask of the sampler (sampler.KINDS)."""
    entropy: bool = False
    """Its rows need each token's entropy (to report it, or to stop at an uncertain token)."""
    children: list[Segment | None] = field(default_factory=list)
    left: int = 0
    fed: int = 0
    """Positions run through the model for this request's rows (its leader row and its children)."""


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
    entropies: list[float] = field(default_factory=list)
    branch: float | None = None
    """The entropy that stopped it before its next token (SegmentRequest.stop_entropy), if one did."""


_COUNTERS = (
    "forward_tokens",
    "prefill_tokens",
    "decode_tokens",
    "decode_steps",
    "requests",
    "cache_hits",
    "cached_tokens",
    "recomputed_tokens",
    "uncached_segments",
    "steps",
    "step_sequences",
    "steps_at_cap",
    "loads_while_running",
    "row_sorts",
)
_TIMERS = ("admit", "prefill", "decode", "sample", "branch", "bookkeeping")
_BLOCK_ROWS = 16
"""Decode rows per attention block at least (a block reads as far as its longest row)."""


def _blocks(rows: int, most: int) -> list[tuple[int, int]]:
    """The decode batch's attention blocks: up to `most` runs of consecutive rows of equal size, of 16 rows or
    more (one block under 32 rows)."""
    k = max(1, min(most, rows // _BLOCK_ROWS))
    size = -(-rows // k)
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


def _read_cost(pos: list[int], most: int) -> int:
    """KV positions the decode blocks read for rows at these positions, in this order."""
    return sum((b - a) * (max(pos[a:b]) + 1) for a, b in _blocks(len(pos), most))


class HFEngine:
    """Continuous-batching tree engine over a Llama-family transformers model (see the package docstring)."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_cache_tokens: int = 1 << 18,
        max_batch_size: int = 256,
        max_batch_tokens: int = 1 << 19,
        max_prefill_tokens: int = 8192,
        vocab_size: int | None = None,
        eos_token_id: int | list[int] | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        attention_blocks: int = 4,
    ):
        """`model`: an HF model directory or a loaded causal LM. `max_cache_tokens`: cap on the positions kept in
        node caches. `max_batch_size`: running sequences at once. `max_batch_tokens`: cap on the sum over running
        sequences of (prefix + max_new_tokens), which bounds the KV buffer. `max_prefill_tokens`: uncached prompt
        tokens admitted into one step (vLLM's max_num_batched_tokens; a longer prompt still runs, alone), so that a
        burst of new prompts does not stall every running row, and the actor's pings, for minutes. `vocab_size`:
        the tokenizer's size (default: read from the model directory's tokenizer, else the config's). `seed`: seeds
        of requests that give none. `attention_blocks`: blocks a decode pass's attention is split into at most, each
        reading only as far as its longest row, with the rows sorted longest first when that pays (1: one block, never
        sorted)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        for name, value in (("max_cache_tokens", max_cache_tokens), ("max_batch_size", max_batch_size),
                            ("max_batch_tokens", max_batch_tokens), ("max_prefill_tokens", max_prefill_tokens),
                            ("attention_blocks", attention_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if isinstance(model, (str, Path)):
            model, vocab_size, eos_token_id = load_model(Path(model), dtype, vocab_size, eos_token_id)
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
        self.decoder = Decoder(model, min(vocab_size, cfg.vocab_size))
        self.vocab_size = self.decoder.vocab_size
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.attention_blocks = attention_blocks
        self.weights_version = 0
        self._rng = random.Random(seed)  # seeds of requests that give none
        self._cache = NodeCache(max_cache_tokens)
        self._kv = self.decoder.new_buffer(0, 0)
        self._positions = torch.arange(0)  # 0..buffer length - 1, for masks
        self._mask_values: tuple[torch.Tensor, ...] = ()  # (0, -inf) in the KV dtype
        self._pending: deque[SegmentRequest] = deque()
        self._rows: list[_Row] = []
        self._reserved_tokens = 0
        self._sequences = 0  # children not yet finished, of running and waiting requests
        self._done: list[SegmentResult] = []
        self._ids: set[str] = set()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._times = dict.fromkeys(_TIMERS, 0.0)

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
            self._sequences += r.n

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
        self._cache.release(keys)

    def stats(self) -> dict:
        out: dict = dict(self._stats)
        out["evictions"] = self._cache.evictions
        out["cache_entries"] = len(self._cache.entries)
        out["cache_tokens"] = self._cache.tokens
        out["running"] = len(self._rows)
        out["pending"] = len(self._pending)
        out["open_sequences"] = self._sequences
        out["max_sequences"] = self.max_batch_size
        out["weights_version"] = self.weights_version
        out.update({f"time_{k}_s": v for k, v in self._times.items()})
        return out

    loads_weights_while_running = True
    """`load_weights` may come between two steps while sequences run (vLLM's engine needs them finished)."""
    loads_weight_stream = False

    @property
    def weights_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def score(self, prefix_ids: list[int], token_ids: list[int], temperature: float) -> list[float]:
        return teacher_forced_logprobs(self.model, prefix_ids, token_ids, self.vocab_size, temperature)

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Copy `state_dict` (HF parameter names) into the model in place, between two steps.

        Sequences that are running go on with the KV their earlier tokens left and sample their next tokens from
        the new weights (PipelineRL's in-flight update): every token's log-prob is the one it was drawn with, and a
        segment reports the version it started under, the oldest that wrote it. Cache entries a caller still
        holds stay (trees being grown continue from them, with the same KV); every other entry is dropped, and no
        new prompt reuses KV of older weights. Requests still waiting are admitted with the new weights."""
        own = dict(self.model.named_parameters())
        tied = {n for n in own if n == "lm_head.weight" and own[n] is self.model.get_input_embeddings().weight}
        unknown = sorted(set(state_dict) - set(self.model.state_dict()))
        missing = sorted(set(own) - set(state_dict) - tied)
        if unknown or missing:
            raise ValueError(f"load_weights: unknown keys {unknown[:5]}, missing keys {missing[:5]}")
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
        self.weights_version = int(version)
        self._stats["loads_while_running"] += bool(self._rows)
        self._cache.forget_unused()

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
        if r.stop_entropy < 0 or r.min_new_tokens < 0 or (r.stop_entropy > 0 and r.min_new_tokens < 1):
            raise ValueError(f"{where}: stop_entropy ({r.stop_entropy}) must be >= 0 and min_new_tokens "
                             f"({r.min_new_tokens}) >= 1 when it is on (a segment holds a token at least)")
        vocab = self.decoder.embed.shape[0]
        if min(r.prefix_ids) < 0 or max(r.prefix_ids) >= vocab:
            bad = [t for t in r.prefix_ids if not 0 <= t < vocab]
            raise ValueError(f"{where}: prefix token ids {bad[:5]} are outside the embedding")
        need = len(r.prefix_ids) + r.max_new_tokens
        if need > self.decoder.max_positions:
            raise ValueError(f"{where}: prefix + max_new_tokens = {need} > the model's {self.decoder.max_positions}")
        if r.n > self.max_batch_size or r.n * need > self.max_batch_tokens:
            raise ValueError(
                f"{where}: {r.n} children of up to {need} positions cannot fit max_batch_size={self.max_batch_size}"
                f" / max_batch_tokens={self.max_batch_tokens}"
            )
        entry = self._cache.entries.get(r.parent_key) if r.parent_key is not None else None
        tomb = self._cache.tombs.get(r.parent_key) if r.parent_key is not None else None
        if (entry is not None and (entry.end != need - r.max_new_tokens - 1
                                   or tuple(r.prefix_ids[entry.start : entry.end]) != entry.tokens)) or (
                tomb is not None and tomb.end != need - r.max_new_tokens - 1):
            raise ValueError(f"{where}: prefix_ids do not end at cached node {r.parent_key!r}")
        cap = self._cache.max_tokens
        if need > cap:
            raise ValueError(f"{where}: a path of {need} positions cannot fit max_cache_tokens={cap}")

    def _plan(self, r: SegmentRequest) -> _Req:
        """Find what the cache holds of this prefix; fix the children's seeds."""
        P = len(r.prefix_ids)
        base, new_base, cached = None, None, 0
        key = r.parent_key
        entry = self._cache.entries.get(key) if key is not None else None
        if entry is not None:  # _check made sure the prefix ends at this entry
            base, cached = key, P - 1
        elif key is not None and key in self._cache.tombs:
            # Evicted: find the deepest ancestor still cached and recompute the rest as a revived entry.
            anc = self._cache.deepest_cached(key)
            cached = self._cache.entries[anc].end if anc is not None else 0
            new_base = (key, anc, True)
        elif P > 1:
            prompt = self._cache.prompts.get(tuple(r.prefix_ids[: P - 1]))
            if prompt is not None:
                base, cached = prompt, P - 1
            else:
                new_base = (self._cache.new_key(), None, False)
        if key is not None and entry is None:
            self._stats["recomputed_tokens"] += P - 1 - cached
        if base is not None:
            self._stats["cache_hits"] += 1
        self._stats["cached_tokens"] += cached
        self._stats["requests"] += 1
        if base is not None:
            self._cache.pin(base, r.n)  # pinned until the children's own entries exist
        seed = r.params.seed if r.params.seed is not None else self._rng.getrandbits(63)
        req = _Req(r, cached, base, new_base, [seed + j for j in range(r.n)], self.weights_version,
                   P + r.max_new_tokens)
        req.children, req.left = [None] * r.n, r.n
        req.kind = kind_of(r.params.temperature, r.params.top_k, r.params.top_p)
        req.entropy = r.params.entropy or r.stop_entropy > 0
        if new_base is not None and new_base[1] is not None:
            self._cache.pin(new_base[1], 1)  # the revived entry will chain to this ancestor
        return req

    # ------------------------------------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Move pending requests into leader rows while the batch limits allow (first come, first served)."""
        rows = len(self._rows)
        admitted: list[_Req] = []
        prefill = 0
        while self._pending:
            r = self._pending[0]
            need = len(r.prefix_ids) + r.max_new_tokens
            if rows + r.n > self.max_batch_size or self._reserved_tokens + r.n * need > self.max_batch_tokens:
                break
            prefill += self._uncached(r)
            if prefill > self.max_prefill_tokens and admitted:
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
            for e in self._cache.chain(anchor):
                self._kv[:, :, row, :, e.start : e.end] = e.kv
            self._rows.append(_Row(q, -1, q.cached, list(q.req.prefix_ids[q.cached :])))

    def _uncached(self, r: SegmentRequest) -> int:
        """Prompt tokens `r` would feed before its first sample, as _plan will find the cache (an evicted entry
        counts in full: an upper bound)."""
        P = len(r.prefix_ids)
        if r.parent_key is not None:
            return 1 if r.parent_key in self._cache.entries else P
        return 1 if tuple(r.prefix_ids[: P - 1]) in self._cache.prompts else P

    def _ensure(self, rows: int, length: int) -> None:
        """Grow the KV buffer to at least `rows` x `length` positions (geometrically, keeping live rows)."""
        have_rows, have_len = self._kv.shape[2], self._kv.shape[4]
        if rows <= have_rows and length <= have_len:
            return
        new_rows = max(rows, min(self.max_batch_size, have_rows * 2)) if rows > have_rows else have_rows
        new_len = max(length, have_len * 3 // 2) if length > have_len else have_len
        new_len = min(self.decoder.max_positions + 1, -(-new_len // 64) * 64)
        kv = self.decoder.new_buffer(new_rows, new_len)
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
        """One model step over every running row: forward (decode rows, then prefill rows), sample, advance."""
        logits, fed, t = self._forward_rows(t)
        tokens, logps, ents, t = self._sample_rows(logits, t)
        self._advance_rows(fed, tokens, logps, ents, t)

    def _forward_rows(self, t: float) -> tuple[torch.Tensor, list[int], float]:
        """The next-token logits of every row (decode rows first, each fed one token; then prefill rows) and the
        tokens fed per row."""
        rows = self._rows
        B = len(rows)
        Bd = next((i for i, r in enumerate(rows) if len(r.feed) > 1), B)
        logits = []
        if Bd:
            pos = self._order_decode_rows(Bd)
            T = max(pos) + 1
            ids = torch.tensor([r.feed[0] for r in rows[:Bd]], device=self.device)[:, None]
            pos_t = torch.tensor(pos, device=self.device)
            mask = self._mask(pos_t[:, None], T)
            spans = [(a, b, max(pos[a:b]) + 1) for a, b in _blocks(Bd, self.attention_blocks)]
            logits.append(self.decoder.forward(self._kv, 0, ids, pos_t[:, None], mask, None, spans))
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
            logits.append(self.decoder.forward(self._kv, Bd, ids, pos_t, mask, last))
            t = self._tick("prefill", t)
        fed = [len(r.feed) for r in rows]
        for r, f in zip(rows, fed):
            r.req.fed += f
        children = sum(r.child >= 0 for r in rows)  # each fed one token
        self._stats["decode_tokens"] += children
        self._stats["prefill_tokens"] += sum(fed) - children
        self._stats["forward_tokens"] += sum(fed)
        return torch.cat(logits) if len(logits) > 1 else logits[0], fed, t

    def _sample_rows(self, all_logits: torch.Tensor, t: float) -> tuple[list[int], list[float], list[float], float]:
        """A token per child: a leader row draws one for each of its children from its logits; its entropy where a
        row of the batch needs it (else NaN)."""
        rows = self._rows
        counts = [r.req.req.n if r.child < 0 else 1 for r in rows]
        seeds, counters = [], []
        for r in rows:
            if r.child < 0:
                seeds.extend(r.req.seeds)
                counters.extend([0] * r.req.req.n)
            else:
                seeds.append(r.req.seeds[r.child])
                counters.append(len(r.tokens))
        if len(rows) != len(seeds):
            all_logits = all_logits.repeat_interleave(torch.tensor(counts, device=self.device), dim=0)
        kinds = {r.req.kind for r in rows}
        kind = kinds.pop() if len(kinds) == 1 else "plain" if kinds == {"unit", "plain"} else "mixed"
        params = [r.req.req.params for r, c in zip(rows, counts) for _ in range(c)] if kind != "unit" else []
        tensor = lambda values: torch.tensor(values, device=self.device)  # noqa: E731
        tokens, logps, ent = sample(
            all_logits,
            tensor([p.temperature for p in params]) if kind in ("plain", "mixed") else None,
            tensor([p.top_k for p in params]) if kind == "mixed" else None,
            tensor([p.top_p for p in params]) if kind == "mixed" else None,
            torch.from_numpy(uniforms(seeds, counters)).to(self.device, torch.float32),
            kind,
            entropy=any(r.req.entropy for r in rows),
        )
        self._stats["steps"] += 1
        self._stats["step_sequences"] += len(seeds)
        self._stats["steps_at_cap"] += len(seeds) >= self.max_batch_size
        ents = ent.tolist() if ent is not None else [math.nan] * len(seeds)
        return tokens.tolist(), logps.tolist(), ents, self._tick("sample", t)

    def _advance_rows(self, fed: list[int], tokens: list[int], logps: list[float], ents: list[float],
                      t: float) -> None:
        """Append each row's token; fork leaders into their children (child 0 keeps the leader's row, the others
        get copies of its KV); finished rows leave."""
        rows = self._rows
        src, dst, finished = [], [], []
        k = 0
        for i in range(len(fed)):
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
                    self._append(row, tokens[k + j], logps[k + j], ents[k + j], finished,
                                 i if j == 0 else len(rows) - 1)
                k += q.req.n
            else:
                self._append(r, tokens[k], logps[k], ents[k], finished, i)
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

    def _order_decode_rows(self, Bd: int) -> list[int]:
        """Sort the decode rows longest first (rows and their KV) when that makes the attention of the decode
        pass's blocks (`_blocks`) read at least 10% fewer positions; return the rows' positions in their order.

        Each block reads as far as its longest row, so a short row among long ones reads positions it never uses:
        rows that join the batch later (new prompts, a tree's next segment beside another tree's first) and rows
        moved into the holes of finished ones leave the batch unsorted (training: 24% more positions read than
        needed; evaluation: 88%). Sorting copies the rows' KV once, about what two decode steps read."""
        rows = self._rows
        pos = [r.pos for r in rows[:Bd]]
        if Bd < 2 * _BLOCK_ROWS or self.attention_blocks == 1:
            return pos
        order = sorted(range(Bd), key=lambda i: -pos[i])
        best = [pos[i] for i in order]
        if _read_cost(pos, self.attention_blocks) <= 1.1 * _read_cost(best, self.attention_blocks):
            return pos
        perm = torch.tensor(order, device=self.device)
        T = best[0]
        self._kv[:, :, :Bd, :, :T] = self._kv[:, :, :Bd, :, :T].index_select(2, perm)
        rows[:Bd] = [rows[i] for i in order]
        self._stats["row_sorts"] += 1
        return best

    def _mask(self, pos: torch.Tensor, T: int) -> torch.Tensor:
        """Additive attention mask [B, 1, Q, T]: query at position p sees positions <= p."""
        if self._positions.shape[0] < T:  # built once per buffer length (small ops add up at narrow batches)
            self._positions = torch.arange(self._kv.shape[4], device=self.device)
            self._mask_values = tuple(torch.tensor(v, dtype=self._kv.dtype, device=self.device)
                                      for v in (0.0, float("-inf")))
        see = self._positions[None, None, :T] <= pos[:, :, None]
        return torch.where(see, *self._mask_values)[:, None]

    def _append(self, row: _Row, token: int, logp: float, ent: float, finished: list[int], index: int) -> None:
        q = row.req.req
        if q.stop_entropy and ent >= q.stop_entropy and len(row.tokens) >= q.min_new_tokens:
            row.branch = ent  # the token is dropped: the children of this segment draw it
            finished.append(index)
            return
        row.tokens.append(token)
        row.logprobs.append(logp)
        if row.req.entropy:
            row.entropies.append(ent)
        row.feed = [token]
        if len(row.tokens) >= q.max_new_tokens or (q.stop_at_eos and token in self._eos):
            finished.append(index)

    def _make_base(self, q: _Req, row: int) -> None:
        """After the leader's pass: keep positions [cached, P-1) as the entry its children chain to."""
        if q.new_base is None:
            return
        key, parent, held = q.new_base
        held = held and key in self._cache.tombs  # a revived key the caller released meanwhile is not held any more
        P = len(q.req.prefix_ids)
        if P - 1 > q.cached:
            kv = self._kv[:, :, row, :, q.cached : P - 1].clone()
            tokens = tuple(q.req.prefix_ids[q.cached : P - 1])
            self._cache.add(Entry(key, parent, q.cached, P - 1, kv, tokens, held, children=q.req.n), force=True)
            if not held:
                self._cache.prompts[tuple(q.req.prefix_ids[: P - 1])] = key
            self._cache.tombs.pop(key, None)
            q.base = key
        elif parent is not None:
            self._cache.pin(parent, q.req.n - 1)  # nothing to revive: children chain to the ancestor
            q.base = parent
            self._cache.tombs.pop(key, None)
        q.new_base = None

    def _finish(self, row: _Row, index: int) -> None:
        """A child is complete: keep its segment's KV rows [P-1, pos) as its cache entry and report it."""
        q = row.req
        P = len(q.req.prefix_ids)
        if row.branch is not None:
            reason = "branch"
        else:
            reason = "eos" if q.req.stop_at_eos and row.tokens[-1] in self._eos else "length"
        seg = Segment(list(row.tokens), list(row.logprobs), reason, None,
                      list(row.entropies) if q.entropy else None, row.branch)
        key = self._cache.new_key()
        # A segment stopped before a token was fed its last token already: the entry leaves it out, as for the
        # others (a child's request feeds its parent's last token).
        end = row.pos - (row.branch is not None)
        kv = self._kv[:, :, index, :, P - 1 : end].clone()
        fed = tuple([q.req.prefix_ids[-1]] + row.tokens[:-1])
        if self._cache.add(Entry(key, q.base, P - 1, end, kv, fed, held=True)):
            seg.cache_key = key
        else:
            self._stats["uncached_segments"] += 1
            if q.base is not None:
                self._cache.unpin(q.base)
        q.children[row.child] = seg
        self._reserved_tokens -= q.need
        self._sequences -= 1
        q.left -= 1
        if q.left == 0:
            self._done.append(SegmentResult(q.req.request_id, list(q.children), q.version, forward_tokens=q.fed,
                                            prefix_key=q.base, cached_tokens=q.cached))

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
