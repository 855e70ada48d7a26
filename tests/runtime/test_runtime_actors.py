"""The actor shells on a real local Ray with a real (random) tiny model: engine batching, weight loading,
routing, and learner ranks joined by torch.distributed (gloo)."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.base import SamplingParams, SegmentRequest
from treepo_ray.engines.tiny import build_tiny_model
from treepo_ray.learner import LearnerConfig, TrainSample
from treepo_ray.runtime.actors import EngineActor, GeneratorPool, LearnerGroup


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def requests(tag, n=3):
    return [SegmentRequest(f"{tag}{i}", [5, 6 + i, 7], 6, n=2, params=SamplingParams(seed=i)) for i in range(n)]


def tokens(results):
    return [[c.token_ids for c in r.children] for r in results]


def test_engine_actor_batches_callers_and_swaps_weights_between_steps(ray_local, tiny):
    engine = EngineActor.options(num_cpus=0).remote("hf", tiny, {}, 1)
    alone_a = ray.get(engine.generate.remote(requests("a")))
    alone_b = ray.get(engine.generate.remote(requests("b")))
    # Two callers at once share the engine's running batch; seeded sampling makes each result independent of
    # what else was in the batch, so they match the calls made one at a time.
    both = ray.get([engine.generate.remote(requests("c")), engine.generate.remote(requests("d"))])
    assert tokens(both[0]) == tokens(alone_a) and tokens(both[1]) == tokens(alone_b)
    assert {r.weights_version for r in alone_a} == {0}

    weights = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    weights = {k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}
    ref = ray.put(weights)  # one object-store copy; the actor resolves the ObjectRef itself
    assert ray.get(engine.load_weights.remote(ref, 7)) == 7
    after = ray.get(engine.generate.remote(requests("e")))
    assert {r.weights_version for r in after} == {7}
    assert tokens(after) != tokens(alone_a)
    assert ray.get(engine.stats.remote())["version"] == 7
    ray.kill(engine)


def test_generator_pool_keeps_a_tree_on_one_engine_and_balances_new_trees():
    pool = GeneratorPool(["e0", "e1"])  # routing only reads positions; no engine is called here
    assert [pool.engine_of(q) for q in ("t1", "t2", "t3")] == [0, 1, 0]
    assert pool.engine_of("t2") == 1 and pool.engine_of("t1") == 0  # sticky
    pool._live[0] -= 1  # what finish() does for a completed tree on engine 0 (without calling an engine)
    pool._home.pop("t1")
    assert pool.engine_of("t4") == 0  # engines 0 and 1 now hold one live tree each: the first one wins
    assert pool.engine_of("t5") == 1
    with pytest.raises(ValueError, match="at least one engine"):
        GeneratorPool([])


def test_learner_group_two_ranks_train_and_export(ray_local, tiny):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2)
    group = LearnerGroup(tiny, cfg, world_size=2, num_cpus=0)
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    metrics = ray.get(group.train_step(ray.put(samples)))
    assert metrics["samples"] == 4 and metrics["version"] == 1 and metrics["skipped"] == 0
    exported = ray.get(group.export_weights())
    before = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    assert set(exported) >= {k for k in before if k != "lm_head.weight"}
    assert any(not torch.equal(exported[k], before[k]) for k in exported)
    for r in group.ranks:
        ray.kill(r)
