"""The generator pool scaled by its policy on a Ray cluster with Ray's real autoscaler (runtime/autoscaling.py: the fake
multi-node provider on this machine): engines ask for a custom `generator` resource, which the head has room for once
and each node of the `gen` type once more. Scale-up asks for a node and gets it, scale-down gives the engine back and
the autoscaler removes its idle node; a node drained (as by a spot notice or `ray drain-node`) and a node killed
mid-run lose no trajectory. The policy's inputs are fed by hand here (the policy itself: test_runtime_scaling.py)."""

import time

import pytest
import ray

from treepo_ray.data.prompts import PromptStream
from treepo_ray.runtime.autoscaling import LocalAutoscalingCluster, drain_node
from runtime_testlib import CACHE, faults, job, started

pytestmark = pytest.mark.slow

STARVED = dict(wait_s=0.8, step_s=1.0, queued=0)  # the learner waited 80% of the step, no batch ahead
AHEAD = dict(wait_s=0.0, step_s=1.0, queued=2)  # every slot of the queue full (max_staleness 2)


@pytest.fixture(scope="module")
def cluster():
    c = LocalAutoscalingCluster({"CPU": 2, "generator": 1},
                                {"gen": {"resources": {"CPU": 0, "generator": 1}, "min_workers": 0, "max_workers": 3}},
                                idle_timeout_s=3.0)
    try:
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def wait_for(condition, timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def run_and_runtime(cluster, tiny):
    """One run's actors for both tests (starting them takes a while): 1 engine, up to 3."""
    run = job([
        "model.path=" + tiny, f"model.cache_dir={CACHE}", "rollout.treepo.width=4",
        "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2",
        "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0", "rollout.treepo.segment_len=8",
        "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.wandb=false", "algo.dynamic_sampling=false",
        "runtime.num_engines=1", "runtime.engine_cpus=0", "runtime.engine_resources={generator: 1}",
        "runtime.elastic.max_engines=3", "runtime.elastic.autoscale=true", "runtime.elastic.poll_s=0.2",
        "runtime.elastic.patience=1", "runtime.elastic.cooldown_s=0"])
    rt = started(run)
    rt.supervisor.policy.warmup = 0  # its decisions are fed by hand here, from the first
    try:
        yield run, rt
    finally:
        rt.supervisor.shutdown()


def test_scale_up_gets_a_node_and_scale_down_gives_it_back(cluster, run_and_runtime):
    _, rt = run_and_runtime
    pool, sup = rt.supervisor.pool, rt.supervisor
    up = sup.scale(**STARVED)
    assert up["pool/target"] == 2 and up["pool/scale_ups"] == 1
    # The engine asked for waits as a pending actor until the autoscaler adds a `gen` node for it.
    assert wait_for(lambda: pool.size == 2) and len(cluster.worker_nodes("generator")) == 1
    down = sup.scale(**AHEAD)
    assert down["pool/target"] == 1 and down["pool/scale_downs"] == 1
    assert pool.size == 1  # out of the member list at once; killed once idle
    assert wait_for(lambda: pool.leaving == 0, 30)
    # Nothing runs on the node any more: the autoscaler removes it after its idle timeout.
    assert wait_for(lambda: not cluster.worker_nodes("generator"), 60)
    assert sup.scale(**AHEAD)["pool/target"] == 1  # never below runtime.num_engines
    totals = faults(rt)
    assert totals["fault/engines_joined"] == 1 and totals["fault/engines_given_back"] == 1, totals
    assert "fault/engines_lost" not in totals


def test_a_drained_node_and_a_killed_node_lose_no_trajectory(cluster, run_and_runtime):
    run, rt = run_and_runtime
    pool, sup = rt.supervisor.pool, rt.supervisor
    for size in (2, 3):  # one engine more at a time, once the last one asked for has joined
        sup.scale(**STARVED)
        assert pool.target == size and wait_for(lambda: pool.size == size)
    sup.policy = None  # from here the target stays 3: the steps' own measures are not this test's subject
    first, second = cluster.worker_nodes("generator")[:2]
    rows, seen = [], {}
    for batch, metrics in rt.loop.steps(0, 3, PromptStream(run.train_set, 0), trees_logged=4):
        rows.append((batch, metrics))
        if batch.step == 0:  # a spot notice: the node goes in 20 s; its engine leaves first
            seen["drained"] = drain_node(first, deadline_s=20)
            seen["left"] = wait_for(lambda: pool.size == 2 and pool.leaving == 0, 30)
        if batch.step == 1:  # a preemption without notice, while the next batches grow
            seen["killed"] = cluster.kill_node(second)
    # The killed node's engine is dropped (heartbeat); both are asked for again (pending: the autoscaler's demand).
    seen["dropped"] = wait_for(lambda: second not in pool.nodes().values(), 30)
    seen["asked_again"] = wait_for(lambda: pool.size + pool.pending == 3, 30)
    totals = faults(rt, rows)
    assert seen["drained"] and seen["left"] and seen["killed"] > 0 and seen["dropped"] and seen["asked_again"], seen
    # The killed node's engine is lost (and a replacement starting there, if one was placed on it by then).
    assert totals["fault/engines_drained"] == 1 and totals["fault/engines_lost"] >= 1, totals
    # Training went on throughout, every tree whole: no trajectory lost.
    assert [b.step for b, _ in rows] == list(range(3))
    assert all(m["actor/samples"] == 16 for _, m in rows)
    assert all(len(t["trajectories"]) == 4 for b, _ in rows for t in b.trees)
