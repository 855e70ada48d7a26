"""Grow many trees on one engine: growers' asks in, engine segments out, prompts advancing independently.

`TreeTracker` is the bookkeeping between growers (layer 1) and an engine: it turns a grower's ready asks into
`SegmentRequest`s (full prefix ids, plus the cache key the engine returned for the node, so a prefix-caching engine
continues without recomputing it) and turns results back into tree nodes. It never calls an engine, so the Ray
runtime reuses it with remote engines. `grow` is the plain local loop over one in-process engine; `StreamLoop` grows
a stream of prompts the way training feeds an engine (each tree at its own pace, new prompts admitted as the engine
has room).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from treepo_ray.engines.base import Engine, SamplingParams, SegmentRequest, SegmentResult
from treepo_ray.tree import Ask, Grower


@dataclass
class _Tracked:
    grower: Grower
    keys: dict[int, str] = field(default_factory=dict)
    """Tree node -> the engine's cache key for it."""
    open: int = 0
    """Requests sent for this grower and not yet delivered."""
    prompt_counted: bool = False
    """A result of an ask at the root has been counted in the tree's `forward_tokens` (its prompt with it)."""


class TreeTracker:
    """Maps growers' asks to engine requests and engine results back to tree nodes (one engine's keys)."""

    def __init__(self, params: SamplingParams | None = None, stop_at_eos: bool = True):
        """`params`: sampling parameters of every request (each ask's seed replaces `params.seed`)."""
        self.params = params or SamplingParams()
        self.stop_at_eos = stop_at_eos
        self._growers: dict[int, _Tracked] = {}  # id(grower) -> its bookkeeping
        self._open: dict[str, tuple[_Tracked, Ask]] = {}  # engine request id -> the grower and ask it answers
        self._sent = 0

    def _tracked(self, grower: Grower) -> _Tracked:
        t = self._growers.get(id(grower))
        if t is None or t.grower is not grower:
            t = self._growers[id(grower)] = _Tracked(grower)
        return t

    def to_requests(self, grower: Grower) -> list[SegmentRequest]:
        """Every ask the grower has ready, as engine requests (request ids are unique across growers)."""
        t = self._tracked(grower)
        out = []
        for ask in grower.asks():
            # The ask's id names the query (unique over a run, so engines shared by several trackers see no
            # clash); the number makes it unique within this tracker too. Nothing reads it back: see `deliver`.
            rid = f"{ask.request_id}#{self._sent}"
            self._sent += 1
            self._open[rid] = (t, ask)
            t.open += 1
            out.append(
                SegmentRequest(
                    request_id=rid,
                    prefix_ids=grower.tree.prefix_ids(ask.node),
                    max_new_tokens=ask.max_new_tokens,
                    n=ask.n,
                    params=replace(self.params, seed=ask.seed),
                    parent_key=t.keys.get(ask.node),
                    stop_at_eos=self.stop_at_eos,
                    stop_entropy=ask.stop_entropy,
                    min_new_tokens=ask.min_new_tokens,
                )
            )
        return out

    def deliver(self, result: SegmentResult) -> tuple[Grower, list[int]]:
        """Hand a result to the grower that asked for it; return that grower and the new node ids."""
        sent = self._open.pop(result.request_id, None)
        if sent is None:
            raise ValueError(f"result for unknown request {result.request_id!r}")
        t, ask = sent
        t.open -= 1
        nodes = t.grower.receive(ask.request_id, result.children)
        for node, seg in zip(nodes, result.children):
            if seg.cache_key is not None:
                t.keys[node] = seg.cache_key
        if result.prefix_key is not None:  # the root's (prompt's) entry: a fallback at the root continues from it
            t.keys.setdefault(ask.node, result.prefix_key)
        # The oldest policy that wrote any of the tree's tokens (what a staleness check must look at).
        meta = t.grower.tree.meta
        meta["weights_version"] = min(meta.get("weights_version", result.weights_version), result.weights_version)
        count_forward(t, ask.node, result)
        return t.grower, nodes

    def release(self, grower: Grower, abandon: bool = False) -> list[str]:
        """Forget a grower; return the cache keys of its tree for `engine.release`. No request may be open unless
        `abandon` (a tree given up midway): its open requests are forgotten too, and a late result is unknown."""
        t = self._growers.get(id(grower))
        if t is None or t.grower is not grower:
            return []
        if t.open and not abandon:
            raise ValueError(f"grower of tree {grower.tree.query_id!r} still has {t.open} open requests")
        for rid in [rid for rid, (tracked, _) in self._open.items() if tracked is t]:
            del self._open[rid]
        del self._growers[id(grower)]
        return list(t.keys.values())

    def open_requests(self) -> int:
        return len(self._open)


def count_forward(t: _Tracked, node: int, result: SegmentResult) -> None:
    """Add what the engine ran for `result` to its tree's meta["forward_tokens"]: the positions it fed for that
    request (SegmentResult.forward_tokens), and, for the tree's first ask at the root only, also the prompt positions
    it took from a cache. So a tree's prompt counts in full once whoever computed it (another tree, an earlier step:
    such a hit must not make a step look cheaper), a fallback ask at the root that reuses the prompt this tree
    computed counts only what it fed, and a continuation that reuses its own parent's cache counts only what it fed.
    An engine that does not count per request (forward_tokens None) leaves the tree without the key."""
    if result.forward_tokens is None:
        return
    meta = t.grower.tree.meta
    fed = result.forward_tokens
    if node == 0 and not t.prompt_counted:
        fed += result.cached_tokens
        t.prompt_counted = True
    meta["forward_tokens"] = meta.get("forward_tokens", 0) + fed


Progress = Callable[[Grower], Any]
_GAUGES = {"cache_entries", "cache_tokens", "running", "pending", "weights_version", "open_sequences", "max_sequences"}


class GrowLoop:
    """`grow` one engine step at a time (so a caller can interleave or time several loops)."""

    def __init__(
        self,
        growers: list[Grower],
        engine: Engine,
        params: SamplingParams | None = None,
        stop_at_eos: bool = True,
        progress: Progress | Any | None = None,
    ):
        self.growers: list[Grower] = []
        self.engine = engine
        self.progress = progress
        self.tracker = TreeTracker(params, stop_at_eos)
        self.left = 0
        self.busy_s = 0.0
        """Wall time spent inside `step` and `add` (the constructor's first requests included)."""
        self._before = engine.stats()
        self.add(growers)

    def add(self, growers: list[Grower]) -> None:
        """Start growing more trees: their first asks go to the engine now."""
        start = time.perf_counter()
        self._add(growers)
        self.busy_s += time.perf_counter() - start

    def _add(self, growers: list[Grower]) -> None:
        for g in growers:
            self.growers.append(g)
            if g.done():
                self._finished(g)
                continue
            self.left += 1
            self.engine.add_requests(self.tracker.to_requests(g))

    def _finished(self, g: Grower) -> None:
        self.engine.release(self.tracker.release(g))
        if self.progress is None:
            return
        if hasattr(self.progress, "update"):
            self.progress.update(1)
        else:
            self.progress(g)

    def step(self) -> bool:
        """One engine step; feed its results to their growers and their new asks to the engine. False when done."""
        if not self.left:
            return False
        start = time.perf_counter()
        if not self.engine.has_unfinished():
            raise RuntimeError(f"{self.left} trees are not done but none of their growers asks for anything")
        for result in self.engine.step():
            g, _ = self.tracker.deliver(result)
            requests = self.tracker.to_requests(g)
            if requests:
                self.engine.add_requests(requests)
            if g.done():
                self.left -= 1
                self._finished(g)
        self._after_step()
        self.busy_s += time.perf_counter() - start
        return self.left > 0

    def _after_step(self) -> None:
        """Hook run after every step (StreamLoop admits new trees here)."""

    def summary(self) -> dict:
        """The engine's counter deltas since the loop started, plus tree counts and `wall_s` (= busy_s)."""
        after = self.engine.stats()
        out = {k: v - self._before.get(k, 0) for k, v in after.items()
               if isinstance(v, (int, float)) and k not in _GAUGES}
        out.update(
            trees=len(self.growers),
            trajectories=sum(len(g.tree.trajectories) for g in self.growers),
            generated_tokens=sum(sum(len(t) for t in g.tree.tokens) for g in self.growers),
            unique_tree_tokens=sum(g.tree.unique_tokens() for g in self.growers),
            wall_s=self.busy_s,
        )
        return out


class StreamLoop(GrowLoop):
    """Grow a stream of trees on one engine as training feeds it: every tree at its own pace, and a new tree admitted
    whenever the engine has room for more sequences than it runs or holds waiting (`engine.stats()`'s `open_sequences`
    below its `max_sequences`), so the batch stays full without piling up trees; or, with `in_flight` > 0, whenever
    fewer than that many trees are growing."""

    def __init__(
        self,
        source: Iterable[Grower],
        engine: Engine,
        params: SamplingParams | None = None,
        stop_at_eos: bool = True,
        progress: Progress | Any | None = None,
        in_flight: int = 0,
    ):
        if in_flight < 0:
            raise ValueError(f"in_flight must be >= 0, got {in_flight}")
        self._source = iter(source)
        self._next: Grower | None = next(self._source, None)
        self.in_flight = in_flight
        super().__init__([], engine, params, stop_at_eos, progress)
        start = time.perf_counter()
        self._after_step()
        self.busy_s += time.perf_counter() - start

    def _room(self) -> bool:
        if self.in_flight:
            return self.left < self.in_flight
        s = self.engine.stats()
        return s["open_sequences"] < s["max_sequences"]

    def _after_step(self) -> None:
        while self._next is not None and (self._room() or not self.left):
            g, self._next = self._next, next(self._source, None)
            self._add([g])


def grow(
    growers: list[Grower],
    engine: Engine,
    params: SamplingParams | None = None,
    stop_at_eos: bool = True,
    progress: Progress | Any | None = None,
) -> dict:
    """Grow every grower's tree to completion on `engine`; return counts and the engine's counter deltas.

    A grower's new asks go to the engine as soon as the grower has them (after each result), so prompts advance
    independently. A finished tree's cache keys are released at once. `progress` is called with each finished
    grower, or, if it has an `update` method (a tqdm bar), updated by 1.
    """
    loop = GrowLoop(growers, engine, params, stop_at_eos, progress)
    while loop.step():
        pass
    return loop.summary()
