"""The engine actor (runtime/engine.py) on a real local Ray with a real (random) tiny model: one running batch for
every caller, and weights swapped between two decode steps."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.base import SamplingParams, SegmentRequest
from treepo_ray.runtime.engine import EngineActor

pytestmark = pytest.mark.slow


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
    assert ray.get(engine.stats.remote())["weights_version"] == 7
    ray.kill(engine)
