"""The learner group (runtime/learner.py) on a real local Ray with a real (random) tiny model: two ranks joined by
torch.distributed (gloo) train as one learner, export the weights and publish them for the generators."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.weights import unpack
from treepo_ray.learner import LearnerConfig, TrainSample
from treepo_ray.runtime.learner import LearnerGroup

pytestmark = pytest.mark.slow


def test_learner_group_two_ranks_train_export_and_publish(ray_local, tiny):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2)
    group = LearnerGroup(tiny, cfg, world_size=2, num_cpus=0)
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    try:
        assert group.published == (0, None)  # nothing published before the first step
        metrics = ray.get(group.train_step(ray.put(samples)))
        assert metrics["samples"] == 4 and metrics["version"] == 1 and metrics["skipped"] == 0
        exported = ray.get(group.export_weights())
        before = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
        assert set(exported) >= {k for k in before if k != "lm_head.weight"}
        assert any(not torch.equal(exported[k], before[k]) for k in exported)
        # What the pool loads: the weights after the step, under the version they were published as (one packed
        # object-store copy, float32 by default).
        group.publish(1)
        version, weights = group.published
        packed = ray.get(weights.packed)
        published = unpack(packed.specs, packed.buffer)
        assert version == 1 and set(published) == set(exported)
        assert all(torch.equal(published[k], exported[k]) for k in published)
    finally:
        for r in group.ranks:
            ray.kill(r)
