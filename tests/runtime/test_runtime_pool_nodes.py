"""The generator pool (runtime/pool.py) following the cluster's size, on a real two-node local Ray
(ray.cluster_utils.Cluster): engines ask for a custom `generator` resource as on the cluster files' generator nodes;
a node that joins gets an engine, a node that goes (killed, as on a spot preemption) takes its engine with it (the
supervisor drops it), with no restart while there is no room; training never stops, and pool/size is logged every
step."""

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from treepo_ray.data.prompts import PromptStream
from runtime_testlib import CACHE, faults, job, started

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"generator": 1},
                                                       "include_dashboard": False})
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def wait_for(condition, timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_pool_grows_on_a_new_node_and_shrinks_when_the_node_goes(cluster, tiny):
    run = job([
        "model.path=" + tiny, f"model.cache_dir={CACHE}", "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2",
        "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",  # limits of these sizes
        "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0",
        "rollout.treepo.segment_len=8", "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.wandb=false",
        "runtime.num_engines=1", "runtime.engine_cpus=0", "runtime.engine_resources={generator: 1}",
        "runtime.elastic.max_engines=2", "runtime.elastic.poll_s=0.2", "algo.dynamic_sampling=false"])
    rt = started(run)
    pool, rows, seen = rt.supervisor.pool, [], {}
    try:
        for batch, metrics in rt.loop.steps(0, 6, PromptStream(run.train_set, 0), trees_logged=4):
            rows.append((batch, metrics))
            if batch.step == 0:  # the autoscaler adds a generator node
                seen["node"] = cluster.add_node(num_cpus=0, resources={"generator": 1})
                seen["grew"] = wait_for(lambda: pool.size == 2)
            if batch.step == 3:  # the node is preempted: its raylet and every actor on it die at once
                cluster.remove_node(seen["node"], allow_graceful=False)
                seen["shrank"] = wait_for(lambda: pool.size == 1)
        assert rt.loop.version == 6
        time.sleep(1.0)  # a few rounds of the watch with the node gone
        pending, size, totals = len(pool._pending), pool.size, faults(rt, rows)
    finally:
        rt.supervisor.shutdown()
    assert seen["grew"] and seen["shrank"]
    # Floor 1, ceiling 2: the lost engine is not replaced while no node offers `generator`.
    assert size == 1 and pending == 0
    assert totals["fault/engines_joined"] == 1 and totals["fault/engines_lost"] == 1, totals
    sizes = [m["pool/size"] for _, m in rows]  # logged with each step's batch
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1 and 1 in sizes[sizes.index(2):]
    # Training went on throughout: every step trained once on full trees.
    assert [b.step for b, _ in rows] == list(range(6))
    assert all(m["actor/samples"] == 16 and m["perf/policy_version"] == b.step + 1 for b, m in rows)
    assert all(len(t["trajectories"]) == 4 for b, _ in rows for t in b.trees)
