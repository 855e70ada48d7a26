"""The node KV cache of the hf engine: one entry per tree node, chained to its parent's, capped with LRU eviction.

Every finished child leaves its own segment's KV rows behind as an entry that points at its parent's entry (a
chain: the tree's KV is stored once, not once per path); a prompt's positions are an entry too. An entry is
`held` while the caller holds its key (returned as a segment's `cache_key`) and has not released it, and pinned
while entries or running children chain to it. The cache is capped at `max_tokens` positions: the least recently
used entries that nothing chains to are evicted. An evicted entry the caller still holds leaves a tomb (its parent
and positions), so a request naming it can find the deepest cached ancestor and recompute the rest.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    """KV rows [start, end) of one node's positions; the positions before `start` live in the parent's chain."""

    key: str
    parent: str | None
    start: int
    end: int
    kv: torch.Tensor
    tokens: tuple[int, ...]
    """The tokens fed at positions start..end-1 (checked against a request's prefix)."""
    held: bool
    """The caller holds the key (it was returned with a segment) and has not released it."""
    children: int = 0
    """Entries (and running children) that chain to this one: it cannot be evicted while > 0."""


@dataclass
class Tomb:
    """What is left of an evicted entry the caller still holds: enough to find its cached ancestors."""

    parent: str | None
    start: int
    end: int


class NodeCache:
    """Entries by key in least-recently-used order, tombs of evicted held entries, and prompts by their tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.tombs: dict[str, Tomb] = {}
        self.prompts: dict[tuple[int, ...], str] = {}
        """Prompt tokens -> the entry holding them (prompt entries have no key the caller could name)."""
        self.tokens = 0
        """Positions held by all entries."""
        self.evictions = 0
        self._tag = uuid.uuid4().hex[:8]  # keys of one cache never collide with another engine's
        self._next_key = 0

    def new_key(self) -> str:
        self._next_key += 1
        return f"{self._tag}-{self._next_key}"

    def deepest_cached(self, key: str | None) -> str | None:
        """The nearest ancestor of `key` (itself included) that is still cached, following tombs; None if none."""
        while key is not None and key not in self.entries:
            key = self.tombs[key].parent if key in self.tombs else None
        return key

    def chain(self, key: str | None) -> list[Entry]:
        """The entries from the root down to `key`, each marked as just used."""
        out = []
        while key is not None:
            e = self.entries[key]
            self.entries.move_to_end(key)
            out.append(e)
            key = e.parent
        return out[::-1]

    def pin(self, key: str, n: int) -> None:
        """`n` more entries or running children chain to `key`."""
        self.entries[key].children += n

    def unpin(self, key: str) -> None:
        """One of them will not after all (a child whose own entry could not be stored)."""
        entry = self.entries[key]
        entry.children -= 1
        self._maybe_free(entry)

    def add(self, entry: Entry, force: bool = False) -> bool:
        """Insert `entry`, evicting LRU entries to respect max_tokens; False if it cannot be stored. `force` stores
        it anyway (the entry running children are about to chain to) and then evicts what it can."""
        size = entry.end - entry.start
        if not force and not self._make_room(size):
            return False
        self.entries[entry.key] = entry
        self.tokens += size
        if force:
            self._make_room(0)
        return True

    def release(self, keys: list[str]) -> None:
        """The caller will not name these keys again: free their entries once nothing chains to them."""
        for key in keys:
            if key in self.tombs:
                del self.tombs[key]
            entry = self.entries.get(key)
            if entry is not None and entry.held:
                entry.held = False
                self._maybe_free(entry)

    def forget_unused(self) -> None:
        """After new weights: drop every entry that no caller holds and nothing chains to (with none held, the
        whole cache), and stop reusing cached prompts (their KV was computed by the old weights)."""
        self.prompts.clear()
        for entry in [e for e in self.entries.values() if not e.held and e.children == 0]:
            if entry.key in self.entries:  # dropping a child may have dropped its parent already
                self._drop(entry)

    def _make_room(self, size: int) -> bool:
        while self.tokens + size > self.max_tokens:
            victim = next((e for e in self.entries.values() if e.children == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, entry: Entry) -> None:
        self.evictions += 1
        if entry.held:
            self.tombs[entry.key] = Tomb(entry.parent, entry.start, entry.end)
        self._drop(entry)

    def _maybe_free(self, entry: Entry) -> None:
        if not entry.held and entry.children == 0:
            self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.key]
        self.tokens -= entry.end - entry.start
        if self.prompts.get(entry.tokens) == entry.key:
            del self.prompts[entry.tokens]
        if entry.parent is not None:
            parent = self.entries[entry.parent]
            parent.children -= 1
            self._maybe_free(parent)
