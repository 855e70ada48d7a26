"""HFEngine against the Hugging Face model it runs, on a real tiny Qwen2 built offline (model forward, KV cache
and scheduling together; the sampler and the cache's bookkeeping alone are tested without a model)."""

from __future__ import annotations

import pytest
import torch
from hf_testlib import hf_logprobs, hf_model

from treepo_ray.engines import make_engine
from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate
from treepo_ray.engines.hf import HFEngine

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 33, 70, 100, 41, 7, 12, 80, 64]
SAMPLED = SamplingParams(temperature=1.0, seed=11)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(model_dir):
    return HFEngine(model_dir, num_threads=1)


def req(rid, prefix, m, n=1, params=SAMPLED, key=None, **kw) -> SegmentRequest:
    return SegmentRequest(rid, list(prefix), m, n=n, params=params, parent_key=key, **kw)


def assert_logprobs_match(hf, prefix: list[int], tokens: list[int], logprobs: list[float]) -> None:
    ref = hf_logprobs(hf, prefix + tokens)
    expect = [ref[len(prefix) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert logprobs == pytest.approx(expect, abs=1e-4)


def test_cached_continuation_matches_hf_forward_over_the_full_sequence(engine, hf):
    (a,) = generate(engine, [req("a", PROMPT, 6, n=3)])
    assert len(a.children) == 3 and all(len(c.token_ids) == 6 and c.cache_key for c in a.children)
    assert len({tuple(c.token_ids) for c in a.children}) == 3  # three different samples of one prefix
    for c in a.children:
        assert_logprobs_match(hf, PROMPT, c.token_ids, c.logprobs)
    # Two levels deeper, continuing from the returned keys (children of a child of a child).
    c0 = a.children[1]
    (b,) = generate(engine, [req("b", PROMPT + c0.token_ids, 5, n=2, key=c0.cache_key)])
    b0 = b.children[0]
    (c,) = generate(engine, [req("c", PROMPT + c0.token_ids + b0.token_ids, 4, key=b0.cache_key)])
    for seg, prefix in ((b.children[0], PROMPT + c0.token_ids), (b.children[1], PROMPT + c0.token_ids),
                        (c.children[0], PROMPT + c0.token_ids + b0.token_ids)):
        assert_logprobs_match(hf, prefix, seg.token_ids, seg.logprobs)
    s = engine.stats()
    assert s["cache_hits"] == 2 and s["recomputed_tokens"] == 0
    # Hand count: prompt once + 5 fed tokens per child of a; 1 (the parent's last token) + 4 per child of b; 1 + 3.
    assert s["forward_tokens"] == (10 + 3 * 5) + (1 + 2 * 4) + (1 + 3)
    assert s["prefill_tokens"] == 10 + 1 + 1
    assert s["cached_tokens"] == (10 + 6 - 1) + (10 + 6 + 5 - 1)


def test_greedy_equals_hf_generate_also_across_segments(engine, hf):
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    ref = ref[0, len(PROMPT):].tolist()
    assert len(set(ref)) > 3  # the model does not just repeat a token
    (whole,) = generate(engine, [req("w", PROMPT, 24, params=GREEDY, stop_at_eos=False)])
    assert whole.children[0].token_ids == ref
    # The same 24 tokens as three cached segments of 8.
    got, key = [], None
    for i in range(3):
        (r,) = generate(engine, [req(f"s{i}", PROMPT + got, 8, params=GREEDY, key=key, stop_at_eos=False)])
        got += r.children[0].token_ids
        key = r.children[0].cache_key
    assert got == ref


def test_prompts_of_different_lengths_prefill_together(engine, hf):
    prompts = [PROMPT, PROMPT[:3], list(range(30, 60)), [42]]
    results = generate(engine, [req(f"p{i}", p, 5, n=2) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        for c in r.children:
            assert_logprobs_match(hf, p, c.token_ids, c.logprobs)
    assert engine.stats()["forward_tokens"] == sum(len(p) + 2 * 4 for p in prompts)


def test_seeds_make_children_independent_of_the_batch(model_dir):
    alone = HFEngine(model_dir, num_threads=1)
    (r,) = generate(alone, [req("x", PROMPT, 8, n=3, params=SamplingParams(temperature=1.0, seed=5))])
    busy = HFEngine(model_dir, num_threads=1)
    others = [req(f"o{i}", list(range(i, i + 7)), 12, n=2, params=SamplingParams(temperature=0.8, seed=i))
              for i in range(3)]
    mixed = generate(busy, others[:2] + [req("x", PROMPT, 8, n=3, params=SamplingParams(temperature=1.0, seed=5))]
                     + others[2:])
    assert [c.token_ids for c in mixed[2].children] == [c.token_ids for c in r.children]
    # Child j of seed s is what a single child of seed s + j draws.
    (single,) = generate(alone, [req("y", PROMPT, 8, params=SamplingParams(temperature=1.0, seed=7))])
    assert single.children[0].token_ids == r.children[2].token_ids
    (other,) = generate(alone, [req("z", PROMPT, 8, params=SamplingParams(temperature=1.0, seed=6))])
    assert other.children[0].token_ids != r.children[0].token_ids


def test_decode_rows_sorted_longest_first_keep_every_row_intact(model_dir, hf):
    """Rows of very different lengths side by side (and rows joining as others finish) are sorted longest first,
    KV and all, so each attention block reads only as far as its longest row; every child still gets exactly the
    log-probs of the model over its own prefix, and the tokens it draws alone."""
    prefixes = [list(range(1, 3 + (40 if i % 2 else 0) + i % 5)) for i in range(40)]  # short and long alternate
    reqs = [req(f"r{i}", p, 6 + i % 7, stop_at_eos=False) for i, p in enumerate(prefixes)]
    engine = HFEngine(model_dir, num_threads=1, max_batch_size=36)  # the last 4 join as the first finish
    results = generate(engine, reqs)
    assert engine.stats()["row_sorts"] > 0
    one_block = HFEngine(model_dir, num_threads=1, max_batch_size=36, attention_blocks=1)
    assert [r.children[0].token_ids for r in generate(one_block, reqs)] == [r.children[0].token_ids for r in results]
    assert one_block.stats()["row_sorts"] == 0
    alone = HFEngine(model_dir, num_threads=1)
    for rq, r in zip(reqs, results):
        (c,) = r.children
        assert len(c.token_ids) == rq.max_new_tokens
        assert_logprobs_match(hf, rq.prefix_ids, c.token_ids, c.logprobs)
        assert generate(alone, [rq])[0].children[0].token_ids == c.token_ids


def test_batch_limits_queue_requests_without_changing_them(model_dir):
    reqs = [req(f"r{i}", PROMPT[i:], 6, n=2, params=SamplingParams(temperature=0.9, top_k=50, seed=i))
            for i in range(4)]
    wide = generate(HFEngine(model_dir, num_threads=1), reqs)
    narrow_engine = HFEngine(model_dir, num_threads=1, max_batch_size=3, max_batch_tokens=40)
    narrow_engine.add_requests(reqs)
    narrow_engine.step()
    assert narrow_engine.stats()["running"] == 2 and narrow_engine.stats()["pending"] == 3
    done = {}
    while narrow_engine.has_unfinished():
        done.update({r.request_id: r for r in narrow_engine.step()})
    assert [[c.token_ids for c in done[r.request_id].children] for r in reqs] == \
        [[c.token_ids for c in w.children] for w in wide]


def test_a_burst_of_prompts_prefills_within_the_token_budget_per_step_without_changing_them(model_dir):
    reqs = [req(f"r{i}", PROMPT[i:] * 2, 4, n=2, params=SamplingParams(temperature=0.9, seed=i))
            for i in range(6)]
    wide = generate(HFEngine(model_dir, num_threads=1), reqs)
    budgeted = HFEngine(model_dir, num_threads=1, max_prefill_tokens=40)  # two or three of these 10-20-token prompts
    budgeted.add_requests(reqs + [req("long", PROMPT * 6, 2)])  # 60 tokens: over the budget, still admitted alone
    done, admitted = {}, []
    while budgeted.has_unfinished():
        before = budgeted.stats()["prefill_tokens"]
        done.update({r.request_id: r for r in budgeted.step()})
        admitted.append(budgeted.stats()["prefill_tokens"] - before)
    assert sum(admitted) == sum(len(r.prefix_ids) for r in reqs) + 60
    assert all(n <= 40 or n == 60 for n in admitted) and 60 in admitted and len([n for n in admitted if n]) >= 4
    assert [[c.token_ids for c in done[r.request_id].children] for r in reqs] == \
        [[c.token_ids for c in w.children] for w in wide]


def test_release_frees_every_entry(engine):
    (a,) = generate(engine, [req("a", PROMPT, 4, n=2)])
    (b,) = generate(engine, [req("b", PROMPT + a.children[0].token_ids, 4, key=a.children[0].cache_key)])
    s = engine.stats()
    # The prompt (an internal entry), a's two children and b's child: 9 + 4 + 4 + 4 positions.
    assert s["cache_entries"] == 4 and s["cache_tokens"] == 9 + 4 + 4 + 4
    engine.release([a.children[0].cache_key, a.children[1].cache_key])
    assert engine.stats()["cache_entries"] == 3  # a's first child is still the parent of b's child
    engine.release([b.children[0].cache_key, "unknown-key"])
    assert engine.stats()["cache_entries"] == 0 and engine.stats()["cache_tokens"] == 0


def test_cache_cap_evicts_lru_and_recomputes_evicted_prefixes(model_dir, hf):
    engine = HFEngine(model_dir, num_threads=1, max_cache_tokens=40)
    (a,) = generate(engine, [req("a", PROMPT, 8, n=2)])  # prompt entry 9 + 8 + 8 = 25 positions
    a0, a1 = a.children
    (b,) = generate(engine, [req("b", PROMPT + a0.token_ids, 8, key=a0.cache_key)])  # + 8
    (c,) = generate(engine, [req("c", list(range(100, 110)), 8)])  # + 9 + 8: over the cap, evict LRU leaves
    s = engine.stats()
    assert s["evictions"] >= 1 and s["cache_tokens"] <= 40
    # a1 was the least recently used leaf: asking for its children recomputes prompt and segment as needed.
    (d,) = generate(engine, [req("d", PROMPT + a1.token_ids, 5, key=a1.cache_key)])
    assert engine.stats()["recomputed_tokens"] > 0
    assert_logprobs_match(hf, PROMPT + a1.token_ids, d.children[0].token_ids, d.children[0].logprobs)
    (e,) = generate(engine, [req("e", PROMPT + a0.token_ids + b.children[0].token_ids, 5,
                                 key=b.children[0].cache_key)])
    assert_logprobs_match(hf, PROMPT + a0.token_ids + b.children[0].token_ids, e.children[0].token_ids,
                          e.children[0].logprobs)
    with pytest.raises(ValueError, match="max_cache_tokens"):
        engine.add_requests([req("big", PROMPT, 35)])


def test_bad_requests_get_clear_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_requests([req("a", [], 4)])
    with pytest.raises(ValueError, match="outside the embedding"):
        engine.add_requests([req("a", [1, 10_000], 4)])
    with pytest.raises(ValueError, match="256"):
        engine.add_requests([req("a", PROMPT, 300)])
    with pytest.raises(ValueError, match="max_batch_size"):
        HFEngine(engine.model, max_batch_size=2).add_requests([req("a", PROMPT, 4, n=3)])
    (a,) = generate(engine, [req("a", PROMPT, 4)])
    with pytest.raises(ValueError, match="do not end at cached node"):
        engine.add_requests([req("b", PROMPT + [1, 2, 3, 4], 4, key=a.children[0].cache_key)])
    assert not engine.has_unfinished()


def test_eos_ends_a_child_and_is_kept(model_dir, hf):
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    ref = ref[0, len(PROMPT):].tolist()
    stop = ref[4]  # pretend the 5th greedy token is EOS
    engine = HFEngine(model_dir, num_threads=1, eos_token_id=stop)
    (r,) = generate(engine, [req("a", PROMPT, 10, params=GREEDY)])
    seg = r.children[0]
    assert seg.finish_reason == "eos" and seg.token_ids == ref[: ref.index(stop) + 1]
    (r,) = generate(engine, [req("b", PROMPT, 10, params=GREEDY, stop_at_eos=False)])
    assert r.children[0].finish_reason == "length" and r.children[0].token_ids == ref


def test_children_ending_at_different_steps_keep_every_row_intact(model_dir, hf):
    """EOS ends siblings at different steps: finished rows are compacted away while the others run on."""
    probe = HFEngine(model_dir, num_threads=1)
    (r,) = generate(probe, [req("p", PROMPT, 12, n=6, stop_at_eos=False)])
    counts: dict[int, int] = {}
    for c in r.children:
        for t in c.token_ids:
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)  # a token the model samples often: an EOS that ends children early
    engine = HFEngine(model_dir, num_threads=1, eos_token_id=stop)
    (a,) = generate(engine, [req("a", PROMPT, 12, n=6)])
    lengths = sorted(len(c.token_ids) for c in a.children)
    assert lengths[0] < 12 and len(set(lengths)) > 1
    for c in a.children:
        assert c.finish_reason == ("eos" if c.token_ids[-1] == stop else "length")
        assert_logprobs_match(hf, PROMPT, c.token_ids, c.logprobs)
    # Continue every child (and one-token children of them) from its key, all in one batch.
    reqs = [req(f"c{j}", PROMPT + c.token_ids, 4, n=2, key=c.cache_key, stop_at_eos=False)
            for j, c in enumerate(a.children)]
    for (rq, cont) in zip(reqs, generate(engine, reqs)):
        for c in cont.children:
            assert_logprobs_match(hf, rq.prefix_ids, c.token_ids, c.logprobs)
    assert engine.stats()["recomputed_tokens"] == 0
    one = generate(engine, [req("o", PROMPT, 1, n=3, stop_at_eos=False)])[0].children
    (deeper,) = generate(engine, [req("d", PROMPT + one[1].token_ids, 3, key=one[1].cache_key,
                                      stop_at_eos=False)])
    assert_logprobs_match(hf, PROMPT + one[1].token_ids, deeper.children[0].token_ids, deeper.children[0].logprobs)


def test_padded_embedding_rows_are_never_sampled(padded_model_dir):
    path = padded_model_dir
    model = hf_model(path)
    assert model.config.vocab_size == 300
    assert hf_logprobs(model, PROMPT)[-1].argmax().item() >= 258  # unclipped, a padding id would win
    engine = make_engine("hf", path, num_threads=1)  # the tokenizer beside the model has 258 tokens
    assert engine.vocab_size == 258
    results = generate(engine, [req("g", PROMPT, 6, params=GREEDY), req("s", PROMPT, 6, n=4)])
    assert all(t < 258 for r in results for c in r.children for t in c.token_ids)


def flipped(model_dir):
    """The model with its MLP weights scaled by -1.5: a policy that samples differently."""
    new = hf_model(model_dir)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if "mlp" in name:
                p.mul_(-1.5)
    return new


def test_load_weights_swaps_in_place_keeps_held_caches_and_reports_the_version(model_dir, hf):
    engine = HFEngine(model_dir, num_threads=1)
    (a,) = generate(engine, [req("a", PROMPT, 6, params=GREEDY)])
    new = flipped(model_dir)
    engine.load_weights(new.state_dict(), version=3)
    # The segment's key is still held: its entry (and the prompt entry it chains to) stays, for the tree that is
    # growing; nothing else is kept, and a new prompt is computed again with the new weights.
    assert engine.stats()["cache_entries"] == 2
    (fresh,) = generate(engine, [req("f", PROMPT, 6)])
    assert fresh.weights_version == 3
    assert engine.stats()["cache_hits"] == 0  # the old prompt's KV was not reused
    assert_logprobs_match(new, PROMPT, fresh.children[0].token_ids, fresh.children[0].logprobs)
    (b,) = generate(engine, [req("b", PROMPT + a.children[0].token_ids, 6, key=a.children[0].cache_key)])
    assert b.weights_version == 3 and engine.stats()["recomputed_tokens"] == 0  # continued from the held entry
    # Once the tree is released, another load leaves nothing behind.
    engine.release([a.children[0].cache_key, b.children[0].cache_key, fresh.children[0].cache_key])
    engine.load_weights(hf.state_dict(), version=4)
    assert engine.stats()["cache_entries"] == 0
    with pytest.raises(ValueError, match="missing keys"):
        engine.load_weights({k: v for k, v in new.state_dict().items() if "layers.0.mlp" not in k}, version=5)


def test_load_weights_between_steps_of_running_sequences(model_dir, hf):
    """An in-flight swap: the running segment's tokens before it are the old model's, those after it the new
    model's (given the KV the earlier tokens left), and the segment reports the version it started under."""
    engine = HFEngine(model_dir, num_threads=1)
    assert engine.loads_weights_while_running
    engine.add_requests([req("r", PROMPT, 8, n=2, stop_at_eos=False)])
    for _ in range(3):  # three tokens per child under version 0
        assert engine.step() == []
    new = flipped(model_dir)
    engine.load_weights(new.state_dict(), version=1)
    results = []
    while engine.has_unfinished():
        results += engine.step()
    (r,) = results
    assert r.weights_version == 0 and all(len(c.token_ids) == 8 for c in r.children)
    assert engine.stats()["loads_while_running"] == 1
    for c in r.children:
        assert_logprobs_match(hf, PROMPT, c.token_ids[:3], c.logprobs[:3])
        # After the swap: the new weights over the old KV of the first positions, so neither model's plain forward
        # gives these log-probs; they are finite log-probs of the tokens drawn.
        assert all(lp <= 0.0 for lp in c.logprobs[3:])
    (later,) = generate(engine, [req("l", PROMPT, 4, n=2)])
    assert later.weights_version == 1
    for c in later.children:
        assert_logprobs_match(new, PROMPT, c.token_ids, c.logprobs)


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32))
    with pytest.raises(ValueError, match="model_type"):
        HFEngine(model)
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("nope", tmp_path)


def test_hf_engine_falls_back_to_prefix_ids_for_a_cache_key_it_does_not_know(model_dir):
    first = HFEngine(model_dir)
    prompt = [5, 6, 7, 8]
    (r,) = generate(first, [SegmentRequest("r0", prompt, 6, params=SamplingParams(seed=1), stop_at_eos=False)])
    child = r.children[0]
    assert child.cache_key is not None
    prefix = prompt + child.token_ids
    follow = lambda key: SegmentRequest("r1", prefix, 6, n=2, params=SamplingParams(seed=2),  # noqa: E731
                                        parent_key=key, stop_at_eos=False)
    (cached,) = generate(first, [follow(child.cache_key)])
    # A new engine (the replacement of a dead one) gets the dead engine's key: unknown here, so it recomputes the
    # prefix from the ids, and seeded sampling gives the same tokens.
    second = HFEngine(model_dir)
    (resent,) = generate(second, [follow(child.cache_key)])
    assert [c.token_ids for c in resent.children] == [c.token_ids for c in cached.children]
    assert second.stats()["cache_hits"] == 0 and first.stats()["cache_hits"] >= 1
    for a, b in zip(resent.children, cached.children):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_entropies_are_the_models_and_a_segment_stops_before_an_uncertain_token(engine, hf):
    """Entropies reported are of the model's next-token distribution; with stop_entropy a child ends right before
    the first token (after min_new_tokens) whose distribution is that uncertain, and its children continue from the
    cached segment, drawing that token, with log-probs equal to an uncut forward's."""
    params = SamplingParams(temperature=1.0, seed=3, entropy=True)
    (a,) = generate(engine, [req("a", PROMPT, 12, n=4, params=params)])
    for c in a.children:
        logp = hf_logprobs(hf, PROMPT + c.token_ids)[len(PROMPT) - 1 : len(PROMPT) - 1 + len(c.token_ids)]
        want = -(logp.exp() * logp).sum(-1)
        assert c.entropies == pytest.approx(want.tolist(), abs=1e-4) and c.branch_entropy is None
    every = [e for c in a.children for e in c.entropies]
    stop = sorted(every)[len(every) // 2]  # the median: some tokens pass it, some do not
    (b,) = generate(engine, [req("b", PROMPT, 12, n=4, params=params, stop_entropy=stop, min_new_tokens=2)])
    cut = 0
    for c, full in zip(b.children, a.children):  # same seeds: the same tokens up to the cut
        n = len(c.token_ids)
        assert c.token_ids == full.token_ids[:n] and n >= 2
        if c.finish_reason == "branch":
            cut += 1
            assert c.branch_entropy == pytest.approx(full.entropies[n], abs=1e-4) and c.branch_entropy >= stop
            assert all(e < stop for e in full.entropies[2:n])  # the first uncertain token past the minimum
        else:
            assert n == 12 and all(e < stop for e in full.entropies[2:])
    assert cut >= 1
    seg = next(c for c in b.children if c.finish_reason == "branch")
    prefix = PROMPT + seg.token_ids
    (d,) = generate(engine, [req("d", prefix, 5, n=2, params=params, key=seg.cache_key)])
    for c in d.children:
        assert_logprobs_match(hf, prefix, c.token_ids, c.logprobs)
    assert engine.stats()["recomputed_tokens"] == 0
    with pytest.raises(ValueError, match="min_new_tokens"):
        engine.add_requests([req("e", PROMPT, 4, stop_entropy=1.0)])
