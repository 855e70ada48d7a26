"""A learner lost with its node is rebuilt on another node from the checkpoint in run storage (job/trainer.py,
runtime/supervisor.py, job/rundir.py), on a real multi-node local Ray (ray.cluster_utils.Cluster) whose nodes run in different working
directories. The run's storage_path is relative: a node that resolved it in its own working directory would write
checkpoints where the driver never looks, and the rebuilt learner would start again from the base weights."""

import json
import os
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.learner import list_checkpoints
from treepo_ray.runtime.train import run
from runtime_testlib import small

pytestmark = pytest.mark.slow


def add_node_in(cluster: Cluster, where: Path, **kwargs):
    """A node whose processes (raylet, workers) run in `where`: they inherit the working directory at start."""
    here = os.getcwd()
    os.chdir(where)
    try:
        return cluster.add_node(**kwargs)
    finally:
        os.chdir(here)


@pytest.fixture
def places(tmp_path, monkeypatch):
    dirs = {name: tmp_path / name for name in ("driver", "b", "c")}
    for d in dirs.values():
        d.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    monkeypatch.chdir(dirs["driver"])
    yield cluster, dirs
    ray.shutdown()
    cluster.shutdown()


def test_a_learner_lost_with_its_node_is_restored_on_another_from_the_shared_checkpoint(places, tiny):
    cluster, dirs = places
    # The learner can only run where `learner_node` is offered: node b now, node c once b is gone.
    node_b = add_node_in(cluster, dirs["b"], num_cpus=1, resources={"learner_node": 1})
    cfg = load_config(DEFAULT_CONFIG, small(tiny, "trainer.storage_path=runs", "trainer.steps=5", "trainer.save_every=1",
                                            "trainer.eval_size=0", "runtime.max_staleness=0", "log.ray_metrics=false",
                                            "runtime.learner_resources={learner_node: 1}", "runtime.learner_cpus=1"))
    moved = []

    def observe(batch, metrics):
        if batch.step == 2 and not moved:  # step 3 trained, its checkpoint not yet written: b is lost, c joins
            add_node_in(cluster, dirs["c"], num_cpus=1, resources={"learner_node": 1})
            cluster.remove_node(node_b, allow_graceful=False)
            moved.append(batch.step)

    summary = run(cfg, observe)
    assert moved == [2] and summary["completed"] and summary["steps"] == 5
    assert summary["faults"]["fault/learner_restarts"] == 1
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == dirs["driver"] / "runs"  # resolved once, on the driver
    # The rebuilt learner, on node c, loaded the newest checkpoint the lost one wrote from node b (step 2 or 3: its
    # worker may outlive the node's raylet for a moment) and went on from that version; from the base weights every
    # later step would be trained with an optimizer-step count behind its step.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [(r["step"], r["actor/optimizer_steps"]) for r in rows if "actor/optimizer_steps" in r]
    assert all(step == version for step, version in trained) and {s for s, _ in trained} == {1, 2, 3, 4, 5}
    assert len(trained) == 5 + summary["faults"].get("fault/steps_redone", 0)
    assert [s for s, _ in list_checkpoints(run_dir)] == [4, 5]
    # Nothing was written relative to the nodes' own working directories.
    assert not any((dirs[n] / "runs").exists() for n in ("b", "c"))
