"""The hf engine's node cache alone: chains, pins, release, the LRU cap and tombs of evicted held entries."""

from __future__ import annotations

import torch

from treepo_ray.engines.hf.cache import Entry, NodeCache


def entry(cache: NodeCache, parent: str | None, start: int, end: int, held: bool = True, children: int = 0) -> Entry:
    kv = torch.full((1, 2, 1, end - start, 1), float(start))
    return Entry(cache.new_key(), parent, start, end, kv, tuple(range(start, end)), held, children)


def test_chain_is_root_first_and_release_frees_up_the_chain():
    cache = NodeCache(max_tokens=100)
    root = entry(cache, None, 0, 5, held=False, children=1)  # a prompt entry: only its child keeps it
    cache.add(root)
    cache.prompts[root.tokens] = root.key
    child = entry(cache, root.key, 5, 9)
    cache.add(child)
    assert [e.key for e in cache.chain(child.key)] == [root.key, child.key]
    assert cache.tokens == 9 and root.key != child.key
    cache.release([child.key])
    assert not cache.entries and cache.tokens == 0 and not cache.prompts  # the prompt entry went with its child


def test_cap_evicts_least_recently_used_unpinned_entries_and_leaves_tombs_of_held_ones():
    cache = NodeCache(max_tokens=10)
    root = entry(cache, None, 0, 4, children=2)
    a, b = entry(cache, root.key, 4, 7), entry(cache, root.key, 4, 7)
    for e in (root, a, b):
        assert cache.add(e)
    cache.chain(a.key)  # a (and root) used last: b is the least recently used leaf
    c = entry(cache, None, 0, 3)
    assert cache.add(c)  # 13 > 10 positions: b goes
    assert b.key not in cache.entries and b.key in cache.tombs and cache.evictions == 1
    assert cache.deepest_cached(b.key) == root.key and cache.deepest_cached(a.key) == a.key
    assert cache.tokens == 10 and root.children == 1  # the evicted child no longer pins its parent
    # Nothing unpinned is left to evict: a new entry is refused, unless forced in (then the cache evicts after).
    cache.pin(c.key, 1)
    cache.pin(a.key, 1)
    assert not cache.add(entry(cache, None, 0, 2))
    forced = entry(cache, None, 0, 2, children=1)
    assert cache.add(forced, force=True) and cache.tokens == 12
    cache.unpin(c.key)  # held by the caller: still cached
    assert c.key in cache.entries
    cache.release([b.key, c.key])
    assert b.key not in cache.tombs and c.key not in cache.entries


def test_forget_unused_keeps_what_is_held_or_chained_to_and_stops_prompt_reuse():
    cache = NodeCache(max_tokens=100)
    prompt = entry(cache, None, 0, 4, held=False, children=1)
    cache.add(prompt)
    cache.prompts[prompt.tokens] = prompt.key
    held = entry(cache, prompt.key, 4, 6)
    cache.add(held)
    other = entry(cache, None, 0, 3, held=False)  # e.g. a prompt entry whose tree is gone
    cache.add(other)
    cache.forget_unused()
    assert set(cache.entries) == {prompt.key, held.key} and not cache.prompts and cache.tokens == 6
    cache.release([held.key])  # the chain goes with the last hold
    cache.forget_unused()
    assert not cache.entries and cache.tokens == 0
