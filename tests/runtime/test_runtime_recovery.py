"""Recovery during real runs on a local Ray with a real (random) tiny model: a learner killed and rebuilt from its
checkpoint while chaos kills engines (through `treepo-ray train` with the chaos options; job/trainer.py), a learner
rank that stops answering (killed by the supervisor's heartbeat, the learner rebuilt), a checkpoint written to a full
disk, a NaN step, and a lost rank taking its learner group down instead of hanging."""

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from treepo_ray.job.config import RuntimeConfig
from treepo_ray.job.faults import LearnerLost
from treepo_ray.job.state import TrainerState
from treepo_ray.learner import LearnerConfig, TrainSample, checkpoint_dir, list_checkpoints, prune_checkpoints
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.supervisor import Supervisor
from treepo_ray.runtime.train import main as train_main
from treepo_ray.runtime.train import run as train_run
from treepo_ray.runtime.weights import WeightSync
from runtime_testlib import job, small, two_engines

pytestmark = pytest.mark.slow


def test_train_survives_engine_chaos_and_a_lost_learner(ray_local, tiny, tmp_path):
    run = tmp_path / "run"
    args = two_engines(tiny, f"trainer.run_dir={run}", "trainer.steps=4", "trainer.save_every=2",
                       "log.trees_per_step=4", "runtime.chaos.kill_every=2",
                       "runtime.chaos.kill_learner_after_step=3")
    assert train_main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    faults = summary["faults"]
    # The learner died after step 3 (checkpoint at step 2): rebuilt once, step 3 trained again.
    assert faults["fault/learner_restarts"] == 1 and faults["fault/steps_redone"] == 1
    assert faults["fault/chaos_kills_learner"] == 1
    assert faults["fault/chaos_kills_engine"] >= 1 and faults["fault/engines_lost"] >= 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "actor/optimizer_steps" in r]
    assert steps == [1, 2, 3, 3, 4]  # the honest log: step 3 twice, once per learner that trained it
    # No step is trained twice by the learner whose weights the run ends with: each logged step's optimizer steps
    # and policy version are the step (the rebuilt learner loaded the checkpoint of step 2 and trained 3 and 4).
    assert all(r["actor/optimizer_steps"] == r["step"] == r["perf/policy_version"] for r in rows
               if "actor/optimizer_steps" in r)
    assert all(r["actor/samples"] == 16 for r in rows if "actor/samples" in r)
    # The prompt stream was rewound to the checkpoint's data position: step 3 saw the same prompts both times.
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    step3 = [t["query_id"] for t in trees if t["step"] == 3]
    assert len(step3) == 8 and step3[:4] == step3[4:]
    assert all(len(t["trajectories"]) == 4 for t in trees)
    assert [s for s, _ in list_checkpoints(run)] == [2, 4]


def learner_pids() -> list[int]:
    """The processes of this Ray's live learner ranks (Ray titles an actor's process `ray::<class>`; its parent is
    the raylet of its session: another Ray on the machine has learners too)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    return [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(
        "ray::LearnerActor") and session in " ".join(p.parent().cmdline())]


def test_a_learner_that_stops_answering_is_rebuilt_from_its_checkpoint_within_the_heartbeat(ray_local, tiny,
                                                                                             tmp_path):
    cfg = job(small(tiny, f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=4", "trainer.save_every=1",
                    "log.trees_per_step=0", "runtime.deadlines.heartbeat_s=3", "runtime.max_staleness=0")).cfg
    stopped = {}

    def observe(batch, metrics):
        if batch.step == 1 and not stopped:  # step 2 is trained; its checkpoint is next, on a rank that is stopped
            (pid,) = learner_pids()
            os.kill(pid, signal.SIGSTOP)
            stopped.update(pid=pid, at=time.monotonic())

    summary = train_run(cfg, observe)
    assert summary["completed"] and summary["steps"] == 4
    f = summary["faults"]
    # The heartbeat killed the stopped rank (its group), the checkpoint's call failed, the learner was rebuilt from
    # the checkpoint of step 1 and step 2 trained again.
    assert f["fault/learners_stuck"] == 1 and f["fault/learner_restarts"] == 1 and f["fault/steps_redone"] == 1, f
    assert [s for s, _ in list_checkpoints(tmp_path / "run")][-1] == 4


@pytest.fixture
def small_disk(tmp_path):
    """A tiny filesystem of our own (tmpfs, when we may mount: root), unmounted afterwards; else a plain folder, and
    the test limits the learner process's file size instead (RLIMIT_FSIZE: writes then fail with EFBIG)."""
    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = os.environ.get("TREEPO_TEST_NO_MOUNT") != "1" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True).returncode == 0
    yield where, mounted
    if mounted:
        subprocess.run(["umount", str(where)], check=False)


def fill(where: Path) -> None:
    with open(where / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def test_checkpoint_on_a_full_disk_keeps_the_previous_one_and_nan_steps_are_skipped(ray_local, tiny, small_disk):
    full_disk, mounted = small_disk

    def limit_file_size(_actor, limit: int | None) -> None:  # runs in the learner's process (shipped by value)
        import resource

        soft = resource.RLIM_INFINITY if limit is None else limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    group = LearnerGroup(tiny, LearnerConfig(lr=1e-3, micro_batch_size=4), RuntimeConfig(learner_cpus=0),
                         WeightSync("object_store", "float32", "gloo", 1 << 20, 60.0))
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    try:
        group.train_step(ray.put(samples))
        group.save_checkpoint(str(checkpoint_dir(full_disk, 1)), TrainerState(1, 4).to_dict())
        if mounted:
            fill(full_disk)
        else:  # the learner process may write no file past 4 kB any more
            ray.get(group.ranks[0].__ray_call__.remote(limit_file_size, 4096))
        # The write fails, and says why; the learner is not lost (the trainer reports it and trains on).
        with pytest.raises(ray.exceptions.RayTaskError, match="No space left" if mounted else "File too large"):
            group.save_checkpoint(str(checkpoint_dir(full_disk, 2)), TrainerState(2, 8).to_dict())
        assert [s for s, _ in list_checkpoints(full_disk)] == [1]
        # Nothing half-written under a real name. (A write that fails inside safetensors, as with EFBIG, leaves
        # the hidden temporary folder behind: the learner's error guard does not catch SafetensorError; the next
        # successful save's pruning removes it, checked below.)
        assert [p.name for p in full_disk.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-00000001"]
        # Training goes on, and the checkpoint kept is whole.
        assert group.train_step(ray.put(samples))["optimizer_steps"] == 2
        assert TrainerState.from_dict(group.load_checkpoint(str(checkpoint_dir(full_disk, 1)))) == TrainerState(1, 4)
        # Room again: the next checkpoint is written, and pruning leaves only it.
        if mounted:
            (full_disk / "filler").unlink()
        else:
            ray.get(group.ranks[0].__ray_call__.remote(limit_file_size, None))
        group.save_checkpoint(str(checkpoint_dir(full_disk, 3)), TrainerState(3, 12).to_dict())
        prune_checkpoints(full_disk, keep=1)
        assert sorted(p.name for p in full_disk.iterdir()) == ["checkpoint-00000003"]
        # A NaN loss: the step is skipped, the weights stay as they were.
        before = ray.get(group.export_weights())
        bad = samples[:1] + [TrainSample([5, 6, 7], [9, 9, 10], advantages=float("nan"))] + samples[2:]
        metrics = group.train_step(ray.put(bad))
        assert metrics["skipped"] == 1
        after = ray.get(group.export_weights())
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        for r in group.ranks:
            ray.kill(r)
        os.sync()


def test_a_lost_rank_takes_its_learner_group_down_instead_of_hanging(ray_local, tiny):
    run = job(small(tiny, "runtime.learner_ranks=2", "runtime.learner_cpus=0", "learner.micro_batch_size=2",
                    "runtime.elastic.poll_s=0.2"))
    sup = Supervisor(run.cfg, run.model_path)
    samples = [TrainSample(list(run.train_set[0].prompt_ids), [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0,
                           old_logprobs=[-1.0] * 3) for i in range(4)]
    try:
        assert sup.learner.train_step(ray.put(samples))["optimizer_steps"] == 1  # a healthy, busy group is left alone
        assert "fault/learner_takedowns" not in sup.fault_metrics()
        group = sup.learner
        pid1 = ray.get(group.ranks[1].__ray_call__.remote(lambda _: os.getpid()))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            step = pool.submit(group.train_step, ray.put(samples * 512))  # seconds long
            time.sleep(0.2)
            os.kill(pid1, 9)  # rank 1 dies in the step
            # Rank 0's step fails either way: gloo notices the dead peer itself, or the supervisor's heartbeat finds
            # rank 1 dead and kills rank 0 (where a backend would wait, NCCL, until its timeout). The call says the
            # learner is lost, and the whole group goes, so that nothing half-alive is reused.
            start = time.monotonic()
            with pytest.raises(LearnerLost):
                step.result(timeout=60)
            assert time.monotonic() - start < 30
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.ranks[0].__ray_call__.remote(lambda _: 1), timeout=30)
    finally:
        sup.shutdown()
