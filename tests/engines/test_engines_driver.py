"""The tree driver: the tracker's routing on hand-made results, then real growers on the real HF engine."""

from __future__ import annotations

import math

import pytest
from hf_testlib import hf_logprobs

from treepo_ray.engines.base import SamplingParams, SegmentResult
from treepo_ray.engines.driver import GrowLoop, StreamLoop, TreeTracker, grow
from treepo_ray.engines.hf import HFEngine
from treepo_ray.tree import (
    Segment,
    SequentialConfig,
    SequentialGrower,
    Tree,
    TreePOConfig,
    TreePOGrower,
    TreeRPOConfig,
    TreeRPOGrower,
)

PROMPTS = [[5, 9, 33, 70, 100, 41, 7], list(range(40, 52)), [3, 4]]


def decode(ids: list[int]) -> str:
    return "".join(chr(40 + t % 80) for t in ids)


def treepo(i: int, prompt: list[int], query_id: str | None = None) -> TreePOGrower:
    cfg = TreePOConfig(width=8, max_depth=4, segment_len=5, repetition_substr_len=0)
    return TreePOGrower(Tree(list(prompt), query_id=query_id or f"q{i}"), cfg, eos_token_id=-1, decode=decode, seed=i)


def expected_forward_tokens(growers) -> int:
    """What a perfect prefix cache runs: each prompt once, then per ask the parent's last (unfed) token, and per
    child every sampled token but its last. That is the unique tokens, minus the last token of every node that no
    ask continued, plus one per extra ask of an already continued node."""
    total = 0
    for g in growers:
        tree = g.tree
        total += tree.unique_tokens() + (g.stats()["asks"] - 1) - (len(tree) - 1)
    return total


def segments(request, version: int = 0) -> SegmentResult:
    """A made-up result for `request`: child j is j + 1 tokens long and cached under a key naming it."""
    rid = request.request_id
    kids = [Segment([7] * (j + 1), [-0.5] * (j + 1), "length", f"{rid}/key{j}") for j in range(request.n)]
    return SegmentResult(rid, kids, version)


def test_tracker_maps_asks_to_requests_and_results_back():
    tracker = TreeTracker(SamplingParams(temperature=0.7, top_p=0.9))
    # Same prompt and same query id: the growers' ask ids are equal, the engine request ids must not be.
    a, b = treepo(0, PROMPTS[0]), treepo(1, PROMPTS[0], query_id="q0")
    ra, rb = tracker.to_requests(a), tracker.to_requests(b)
    assert tracker.to_requests(a) == []  # each ask is sent once
    assert len(ra) == len(rb) == 1 and ra[0].request_id != rb[0].request_id and tracker.open_requests() == 2
    assert ra[0].prefix_ids == PROMPTS[0] and ra[0].parent_key is None and ra[0].n == 2
    assert ra[0].params.temperature == 0.7 and ra[0].params.top_p == 0.9 and ra[0].params.seed is not None
    with pytest.raises(ValueError, match="open requests"):
        tracker.release(a)
    # b's answer first: each result reaches the grower that asked, whatever the order.
    grower, nodes = tracker.deliver(segments(rb[0], version=2))
    assert grower is b and nodes == [1, 2] and b.tree.tokens[1:] == [[7], [7, 7]] and len(a.tree) == 1
    first = segments(ra[0])
    grower, nodes = tracker.deliver(first)
    assert grower is a and nodes == [1, 2]
    assert [a.tree.tokens[n] for n in nodes] == [c.token_ids for c in first.children]
    assert a.tree.meta["weights_version"] == 0 and b.tree.meta["weights_version"] == 2
    # Follow-up asks continue nodes 1 and 2 from the cache keys the engine returned for them.
    key_of = {tuple(a.tree.prefix_ids(n)): c.cache_key for n, c in zip(nodes, first.children)}
    follow = tracker.to_requests(a)
    assert len(follow) == 2 and all(key_of[tuple(r.prefix_ids)] == r.parent_key for r in follow)
    with pytest.raises(ValueError, match="unknown request"):
        tracker.deliver(SegmentResult("nope", []))
    with pytest.raises(ValueError, match="unknown request"):
        tracker.deliver(first)  # delivered once only
    results = [first] + [segments(r) for r in follow]
    for r in results[1:]:
        tracker.deliver(r)
    assert sorted(tracker.release(a)) == sorted(c.cache_key for r in results for c in r.children)
    assert tracker.release(a) == [] and tracker.open_requests() == 0


def test_an_abandoned_grower_is_forgotten_with_its_open_requests():
    # A tree given up midway (its shard failed; the scheduler stops it): its caches are freed, its open requests
    # forgotten (a late answer is refused as unknown), and the other trees' bookkeeping is untouched.
    tracker = TreeTracker()
    a, b = treepo(0, PROMPTS[0]), treepo(1, PROMPTS[1])
    ra, rb = tracker.to_requests(a), tracker.to_requests(b)
    first = segments(ra[0])
    tracker.deliver(first)
    follow = tracker.to_requests(a)
    assert follow and tracker.open_requests() == 1 + len(follow)
    assert sorted(tracker.release(a, abandon=True)) == sorted(c.cache_key for c in first.children)
    assert tracker.open_requests() == 1 and tracker.release(a) == []
    with pytest.raises(ValueError, match="unknown request"):
        tracker.deliver(segments(follow[0]))
    grower, nodes = tracker.deliver(segments(rb[0]))
    assert grower is b and nodes == [1, 2]


# ---- on the real engine ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_treepo_trees_cost_exactly_their_unique_tokens(model_dir, hf):
    engine = HFEngine(model_dir, num_threads=1)
    growers = [treepo(i, p) for i, p in enumerate(PROMPTS)]
    done = []
    out = grow(growers, engine, SamplingParams(temperature=1.0), stop_at_eos=False, progress=done.append)
    assert done and set(map(id, done)) == set(map(id, growers))
    assert all(g.done() and len(g.tree.trajectories) == 8 for g in growers)
    assert out["trajectories"] == 24 and out["trees"] == 3
    unique = sum(g.tree.unique_tokens() for g in growers)
    assert out["unique_tree_tokens"] == unique
    assert out["forward_tokens"] == expected_forward_tokens(growers) <= unique
    assert out["recomputed_tokens"] == 0 and out["cache_hits"] == out["requests"] - len(PROMPTS)
    # Every finished tree's keys were released.
    assert engine.stats()["cache_entries"] == 0 and engine.stats()["running"] == 0
    # Token log-probs along a whole trajectory are the HF model's own.
    tree = growers[1].tree
    node = tree.trajectories[-1]
    ids = tree.prefix_ids(node)
    ref = hf_logprobs(hf, ids)
    P = len(tree.prompt_ids)
    expect = [ref[P - 1 + i, t].item() for i, t in enumerate(tree.response_ids(node))]
    assert tree.response_logprobs(node) == pytest.approx(expect, abs=1e-4)


@pytest.mark.slow
def test_growth_is_reproducible_and_sequential_and_treerpo_work_too(model_dir):
    engine = HFEngine(model_dir, num_threads=1)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        growers = [treepo(i, p) for i, p in enumerate(PROMPTS)]
        grow(growers, engine, params, stop_at_eos=False)
        runs.append([g.tree.to_dict() for g in growers])
    assert runs[0] == runs[1]
    seq = [SequentialGrower(Tree(p, query_id=f"s{i}"), SequentialConfig(group_size=4, segment_len=3, max_depth=3,
                            repetition_substr_len=0), eos_token_id=-1, decode=decode, seed=i)
           for i, p in enumerate(PROMPTS)]
    rpo = [TreeRPOGrower(Tree(p, query_id=f"r{i}"), TreeRPOConfig(n_children=2, max_depth=3, step_len=3),
                         eos_token_id=-1, decode=decode, seed=i) for i, p in enumerate(PROMPTS)]
    out = grow(seq + rpo, engine, params, stop_at_eos=False)
    assert [len(g.tree.trajectories) for g in seq] == [4] * 3 and [len(g.tree.trajectories) for g in rpo] == [8] * 3
    assert out["forward_tokens"] == expected_forward_tokens(seq + rpo)
    assert all(len(g.tree.response_ids(n)) == 9 for g in seq + rpo for n in g.tree.trajectories)
    assert engine.stats()["cache_entries"] == 0


@pytest.mark.slow
def test_each_tree_counts_its_own_forward_tokens_while_batches_overlap(model_dir):
    """Two batches grow on one engine at once and new weights arrive midway (runtime.max_staleness 1): each tree's
    meta["forward_tokens"] is exactly what a perfect cache runs for it, so each batch's tree/forward_per_unique is its
    own (the engine's counter over a batch's lifetime held the other batch's work: 1.40 in the SmolLM2 job). A tree
    whose prompt another tree had computed counts it in full; a fallback at the root after the weight load continues
    from the tree's prompt entry instead of recomputing the prompt (it did: +P-1 tokens per such fallback)."""
    from treepo_ray.runtime.batches import forward_metrics

    cfg = TreePOConfig(width=8, max_depth=4, segment_len=5, repetition_substr_len=0, fallback_policy="random")

    def grower(i: int, prompt: list[int], query_id: str) -> TreePOGrower:
        return TreePOGrower(Tree(list(prompt), query_id=query_id), cfg, eos_token_id=-1, decode=decode, seed=i)

    engine = HFEngine(model_dir, num_threads=1, eos_token_id=list(range(3, 40)))  # frequent EOS: fallbacks
    first = [grower(i, p, f"a{i}") for i, p in enumerate(PROMPTS)]
    loop = GrowLoop(first, engine, SamplingParams(temperature=1.0), stop_at_eos=True)
    loop.step()
    # The next batch starts while the first grows; its first tree has the prompt of the first batch's first tree.
    second = [grower(7, PROMPTS[0], "b0"), grower(8, PROMPTS[1][1:], "b1")]
    loop.add(second)
    loop.step()
    engine.load_weights({n: p.detach().clone() for n, p in engine.model.named_parameters()}, 1)
    while loop.step():
        pass
    trees = [g.tree for g in first + second]
    assert all(len(t.trajectories) == 8 for t in trees)
    # Root fallbacks after the load (more children of the root than its first ask's), in both batches.
    root_fallbacks = [g.tree.query_id for g in first + second if len(g.tree.children(0)) > g.init_divergence]
    assert root_fallbacks == ["a0", "b1"]
    for g in first + second:
        assert g.tree.meta["forward_tokens"] == expected_forward_tokens([g]), g.tree.query_id
    for batch in (first, second):
        m = forward_metrics([g.tree for g in batch])
        assert m["tree/forward_tokens"] == expected_forward_tokens(batch)
        assert m["tree/forward_per_unique"] <= 1.0
    # b0's prompt came from a0's cache: the engine ran it once, the trees count it once each.
    stats = engine.stats()
    assert stats["recomputed_tokens"] == 0
    assert stats["forward_tokens"] == expected_forward_tokens(first + second) - (len(PROMPTS[0]) - 1)
    assert stats["cache_entries"] == 0
    assert math.isnan(forward_metrics([Tree([1, 2])])["tree/forward_per_unique"])  # an engine that does not count


def paths(grower) -> list[tuple[int, ...]]:
    return sorted(tuple(grower.tree.response_ids(n)) for n in grower.tree.trajectories)


@pytest.mark.slow
def test_stream_admits_trees_as_room_frees_and_grows_the_same_trees(model_dir):
    """A stream through an engine capped at 6 sequences: trees are admitted while the engine has room, or up to
    `in_flight` at once; seeded per request, every tree comes
    out as it does grown alone (node numbering and log-prob rounding aside)."""
    prompts = [PROMPTS[i % 3][: 4 + i] for i in range(6)]
    alone = []
    for i, p in enumerate(prompts):
        g = treepo(i, p)
        grow([g], HFEngine(model_dir, num_threads=1), SamplingParams(temperature=1.0), stop_at_eos=False)
        alone.append(paths(g))
    for in_flight in (0, 2):
        engine = HFEngine(model_dir, num_threads=1, max_batch_size=6)
        loop = StreamLoop((treepo(i, p) for i, p in enumerate(prompts)), engine, SamplingParams(temperature=1.0),
                          stop_at_eos=False, in_flight=in_flight)
        most_trees = loop.left
        while loop.step():
            most_trees = max(most_trees, loop.left)
        assert [paths(g) for g in loop.growers] == alone
        out = loop.summary()
        assert out["trees"] == 6 and out["trajectories"] == 48 and out["steps_at_cap"] > 0
        assert out["step_sequences"] <= 6 * out["steps"]
        if in_flight:
            assert most_trees == 2
        else:
            # Three first asks of 2 children fill the 6 rows; a tree joins later only when the queue has run dry,
            # and by then the trees in flight wait for their own wider rounds.
            assert most_trees == 3
    assert engine.stats()["cache_entries"] == 0 and engine.stats()["open_sequences"] == 0
