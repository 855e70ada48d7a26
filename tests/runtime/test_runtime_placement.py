"""Placement on a local two-node Ray that advertises GPUs (no GPU needed to check where things land): learner ranks
as one placement group packed on one node with a GPU each, and a tensor-parallel vLLM engine in a placement group of
one bundle per GPU on one node, as vLLM's Ray executor uses it, released when the engine goes."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treepo_ray.job.config import RuntimeConfig
from treepo_ray.learner import LearnerConfig
from treepo_ray.runtime.engine import engine_placement
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import actor_id
from treepo_ray.runtime.pool import EngineSpec
from treepo_ray.runtime.weights import WeightSync

RANKS = RuntimeConfig(learner_ranks=2, learner_cpus=1, learner_gpus=1, learner_resources={"learner_gpu": 1})
OBJECT_STORE = WeightSync("object_store", "float32", "gloo", 1 << 20, 60.0)

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes below run in Ray workers


@pytest.fixture(scope="module")
def two_nodes():
    """Head: 1 GPU for a learner, 2 CPUs. Second node: 2 learner GPUs and 2 generator GPUs, 4 CPUs."""
    # The GPUs are advertised, not real: Ray is told not to set CUDA_VISIBLE_DEVICES in its workers (they inherit
    # this variable from the nodes started here), so the ranks' CUDA check (a GPU torch cannot use stops a rank;
    # tests/runtime/test_runtime_gpu_assigned.py) lets them start on the CPU, while ray.get_gpu_ids() still says
    # which GPUs each was given.
    os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, num_gpus=1, resources={"learner_gpu": 1}, include_dashboard=False))
    node = cluster.add_node(num_cpus=4, num_gpus=4, resources={"learner_gpu": 2, "generator_gpu": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    yield node.node_id
    ray.shutdown()
    cluster.shutdown()
    del os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]


def _where(_actor) -> tuple[str, list]:
    return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


def _available(key: str) -> float:
    return ray.available_resources().get(key, 0.0)


def test_learner_ranks_pack_on_one_node_with_a_gpu_each(two_nodes, tiny):
    # Unplaced, rank 0 would take the head's learner GPU and rank 1 the other node's: one group split in two.
    group = LearnerGroup(tiny, LearnerConfig(), RANKS, OBJECT_STORE)
    try:
        places = ray.get([r.__ray_call__.remote(_where) for r in group.ranks])
        assert {node for node, _ in places} == {two_nodes}
        assert sorted(len(gpus) for _, gpus in places) == [1, 1] and places[0][1] != places[1][1]
        assert _available("learner_gpu") == 1.0  # the head's, untouched
    finally:
        group.close()
    deadline = time.monotonic() + 30
    while _available("learner_gpu") < 3.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _available("learner_gpu") == 3.0  # close() gave the whole group's room back
    # A group dropped without close() (a run that ends without shutdown) gives it back too.
    group = LearnerGroup(tiny, LearnerConfig(), RANKS, OBJECT_STORE)
    assert _available("learner_gpu") == 1.0
    del group
    gc.collect()
    deadline = time.monotonic() + 30
    while _available("learner_gpu") < 3.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _available("learner_gpu") == 3.0


def test_tensor_parallel_engine_runs_in_one_nodes_gpu_bundles_until_released(two_nodes, tiny):
    spec = EngineSpec("vllm", tiny, {"tensor_parallel_size": 2}, 1, 1, 2, {"generator_gpu": 2})
    assert spec.demand() == {"CPU": 1.0, "GPU": 2.0, "generator_gpu": 2.0}
    with pytest.raises(ValueError, match="tensor_parallel_size = 2: each engine needs 2 GPUs"):
        EngineSpec("vllm", tiny, {"tensor_parallel_size": 2}, 1, 1, 1, {})

    # The engine actor as spec.start() places it, doing what vLLM does inside it: EngineArgs takes the placement
    # group the actor runs in, and RayExecutorV2 starts one worker per bundle (num_gpus=1, num_cpus=0, bundle i).
    def start_workers(_actor):
        group = ray.util.get_current_placement_group()
        worker = ray.remote(num_cpus=0, num_gpus=1)(type("Worker", (), {"where": lambda self: _where(self)}))
        workers = [worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i)).remote() for i in range(len(group.bundle_specs))]
        return group.bundle_specs, _where(None), ray.get([w.where.remote() for w in workers])

    group = engine_placement(2, 1, {"generator_gpu": 2})
    probe = ray.remote(num_cpus=1)(type("Probe", (), {})).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()
    bundles, actor_place, workers = ray.get(probe.__ray_call__.remote(start_workers))
    assert bundles == [{"GPU": 1.0, "generator_gpu": 1.0, "CPU": 1.0}, {"GPU": 1.0, "generator_gpu": 1.0}]
    assert actor_place == (two_nodes, [])  # the engine actor holds no GPU: its workers do
    assert {node for node, _ in workers} == {two_nodes}  # the only node with generator GPUs, all on it
    assert sorted(len(gpus) for _, gpus in workers) == [1, 1] and workers[0][1] != workers[1][1]
    ray.kill(probe)
    remove_placement_group(group)

    # The real engine actor: started in such a group, which the spec keeps until the pool releases it (vLLM is not
    # installed here, so this one fails in its constructor, as a lost engine would).
    actor = spec.start()
    with pytest.raises(ray.exceptions.RayActorError, match="No module named 'vllm'"):
        ray.get(actor.stats.remote())
    assert list(spec.groups) == [actor_id(actor)]
    spec.release(keep=set())
    deadline = time.monotonic() + 30
    while _available("GPU") < 5.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _available("GPU") == 5.0 and _available("generator_gpu") == 2.0 and not spec.groups
