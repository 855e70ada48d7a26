"""The learner group (runtime/learner.py) on a real local Ray with a real (random) tiny model: two ranks joined by
torch.distributed (gloo) train as one learner, export the weights and publish them for the generators; a rank that
cannot be scheduled stops the run in time, named with the resources it asked for."""

import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.weights import unpack
from treepo_ray.job.config import DeadlineConfig
from treepo_ray.learner import LearnerConfig, TrainSample
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import DeadlineExceeded

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


def test_a_learner_that_cannot_be_scheduled_is_named_with_what_it_asked_for(ray_local, tiny):
    with pytest.raises(DeadlineExceeded, match=r"not started within 2s \(runtime.deadlines.start_s\): learner rank 0 "
                                               r"\(asks \{'CPU': 1, 'learner_gpu': 1\}\); the cluster has free"):
        LearnerGroup(tiny, LearnerConfig(), world_size=1, num_cpus=1, resources={"learner_gpu": 1},
                     deadlines=DeadlineConfig(start_s=2))
    # Nothing is left pending (an autoscaler would chase its demand): the whole cluster is free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2
