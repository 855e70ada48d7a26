"""Fault tolerance pieces that need no Ray cluster: guarded decoding and rewards, the fault journal's totals, the
elastic pool's routing table, resource fitting, config checks, and the engine falling back to prefix ids when a
request names a cache key it does not know (what a re-sent request after an engine loss does)."""

import math

import pytest

from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate
from treepo_ray.engines.hf import HFEngine
from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model, build_tokenizer
from treepo_ray.runtime.elastic import ElasticGeneratorPool, EngineSpec
from treepo_ray.runtime.fault_config import ChaosConfig, ElasticConfig, FaultConfig
from treepo_ray.engines.decode import safe_decode
from treepo_ray.runtime.registry import event_metrics, sanitize_scores


def test_safe_decode_never_raises_and_marks_bad_ids():
    tok = build_tokenizer()  # 258 ids: EOS, PAD, then one per byte (byte b is id b + 2)
    good = [ord("4") + 2, ord("2") + 2]
    assert safe_decode(tok, good) == tok.decode(good) == "42"
    # An id past the vocabulary (a padded embedding matrix can sample one) and ids the fast tokenizer cannot even
    # convert (negative, > 2**32) would raise OverflowError in tokenizer.decode.
    with pytest.raises(OverflowError):
        tok.decode([-1])
    assert safe_decode(tok, [good[0], 300, good[1]]) == "4\ufffd2"
    assert safe_decode(tok, [-1, good[0], 2**40]) == "\ufffd4\ufffd"
    assert safe_decode(tok, ["x", None]) == "\ufffd"
    assert safe_decode(tok, []) == ""


def test_sanitize_scores_turns_nan_inf_and_garbage_into_failures():
    out, reasons = sanitize_scores([1.0, math.nan, -math.inf, "x", 0.5], 5, failure_score=-1.0)
    assert out == [1.0, -1.0, -1.0, -1.0, 0.5]
    assert len(reasons) == 3 and "score 1 is nan" in reasons[0]
    out, reasons = sanitize_scores([1.0], 3, failure_score=0.0)  # a wrong count fails the whole call
    assert out == [0.0, 0.0, 0.0] and "1 scores for 3 solutions" in reasons[0]
    out, reasons = sanitize_scores(None, 2, failure_score=0.0)
    assert out == [0.0, 0.0] and reasons


def test_event_metrics_sums_counts_per_kind():
    events = [(0.0, "resent_requests", "a", 3), (1.0, "engines_lost", "b", 1), (2.0, "resent_requests", "c", 2)]
    assert event_metrics(events) == {"fault/resent_requests": 5.0, "fault/engines_lost": 1.0}
    assert event_metrics([]) == {}


def test_elastic_pool_routes_sticky_rehomes_on_loss_and_never_readmits_the_dead():
    pool = ElasticGeneratorPool(registry=None, engines={"a": "A", "b": "B"})  # routing only; no engine is called
    assert [pool.engine_of(q) for q in ("t1", "t2", "t3")] == [0, 1, 0]
    assert pool.engines[pool.engine_of("t2")] == "B" and pool.engine_of("t1") == 0  # sticky
    pool._lost("a")  # what a failed call does: t1 and t3 lose their home, the engine is gone for good
    assert pool.engines == ["B"] and pool.engine_of("t1") == 0 and pool.engine_of("t3") == 0
    pool.set_engines(5, {"a": "A", "b": "B", "c": "C"})  # a stale member list still naming "a"
    assert pool.engines == ["B", "C"] and pool._epoch == 5
    assert pool.engines[pool.engine_of("t4")] == "C"  # the newcomer has no live trees: new trees go there
    pool.finish("t2", [])
    pool.set_engines(6, {"c": "C"})  # "b" left: its trees move on their next request
    assert pool.engines[pool.engine_of("t1")] == "C"
    pool.set_engines(7, {})
    with pytest.raises(RuntimeError, match="no live engine"):
        pool.engine_of("t9")


def test_engine_spec_asks_for_configured_resources():
    spec = EngineSpec("hf", "m", num_cpus=1, num_gpus=0, resources={"generator_gpu": 1})
    assert spec.demand() == {"CPU": 1.0, "generator_gpu": 1.0}
    assert spec.fits({"CPU": 4.0, "generator_gpu": 1.0})
    assert not spec.fits({"CPU": 4.0}) and not spec.fits({"CPU": 0.5, "generator_gpu": 2.0})


def test_fault_configs_reject_bad_values():
    with pytest.raises(ValueError, match="max_resends"):
        FaultConfig(max_resends=-1)
    with pytest.raises(ValueError, match="verifier_call_timeout_s"):
        FaultConfig(verifier_call_timeout_s=0)
    with pytest.raises(ValueError, match="how"):
        ChaosConfig(how="nuke")
    with pytest.raises(ValueError, match="kill_generator_every"):
        ChaosConfig(kill_generator_every=-1)
    with pytest.raises(ValueError, match="max_engines"):
        ElasticConfig(max_engines=-2)


def test_hf_engine_falls_back_to_prefix_ids_for_a_cache_key_it_does_not_know(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1,
                                                           max_positions=64))
    first = HFEngine(path)
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
    second = HFEngine(path)
    (resent,) = generate(second, [follow(child.cache_key)])
    assert [c.token_ids for c in resent.children] == [c.token_ids for c in cached.children]
    assert second.stats()["cache_hits"] == 0 and first.stats()["cache_hits"] >= 1
    for a, b in zip(resent.children, cached.children):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
