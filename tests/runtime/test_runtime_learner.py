"""The learner group (runtime/learner.py) on a real local Ray with a real (random) tiny model: two ranks joined by
torch.distributed (gloo) train as one learner, export the weights and publish them for the generators; a rank that
cannot be scheduled stops the run in time, named with the resources it asked for."""

import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.weights import unpack
from treepo_ray.job.config import DeadlineConfig, RuntimeConfig
from treepo_ray.learner import LearnerConfig, TrainSample
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import DeadlineExceeded
from treepo_ray.runtime.weights import WeightSync

OBJECT_STORE = WeightSync("object_store", "float32", "gloo", 1 << 20, 60.0)

pytestmark = pytest.mark.slow


def test_learner_group_two_ranks_train_export_and_publish(ray_local, tiny):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2)
    group = LearnerGroup(tiny, cfg, RuntimeConfig(learner_ranks=2, learner_cpus=0), OBJECT_STORE)
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    try:
        metrics = group.train_step(ray.put(samples))
        assert metrics["samples"] == 4 and metrics["optimizer_steps"] == 1 and metrics["skipped"] == 0
        exported = ray.get(group.export_weights())
        before = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
        assert set(exported) >= {k for k in before if k != "lm_head.weight"}
        assert any(not torch.equal(exported[k], before[k]) for k in exported)
        # What the pool loads: the weights after the step (one packed object-store copy, float32 here), exported
        # before publish returns.
        weights = group.publish(1)
        assert weights.nbytes > 0
        packed = ray.get(weights.packed)
        published = unpack(packed.specs, packed.buffer)
        assert set(published) == set(exported)
        assert all(torch.equal(published[k], exported[k]) for k in published)
    finally:
        group.close()


def test_a_learner_that_cannot_be_scheduled_is_named_with_what_it_asked_for(ray_local, tiny):
    with pytest.raises(DeadlineExceeded, match=r"not started within 2s \(runtime.deadlines.start_s\): learner rank 0 "
                                               r"\(asks \{'CPU': 1.0, 'learner_gpu': 1.0\}\); the cluster has free"):
        LearnerGroup(tiny, LearnerConfig(), RuntimeConfig(learner_resources={"learner_gpu": 1},
                                                          deadlines=DeadlineConfig(start_s=2)), OBJECT_STORE)
    # Nothing is left pending (an autoscaler would chase its demand): the whole cluster is free again.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2
