"""Faults during real runs on a local Ray with a real (random) tiny model: engines killed mid-segment (ray.kill and
SIGKILL of the actor's process), a learner killed and rebuilt from its checkpoint (through `treepo-ray train` with
the chaos options), verifiers lost or timing out, a checkpoint written to a full disk, and a NaN step."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoTokenizer

from treepo_ray import config as config_io
from treepo_ray.data.synthetic import DATA_SOURCE
from treepo_ray.learner import LearnerConfig, TrainSample, checkpoint_dir, list_checkpoints, prune_checkpoints
from treepo_ray.runtime.actors import LearnerGroup
from treepo_ray.runtime.config import DEFAULT_CONFIG, TrainConfig
from treepo_ray.runtime.elastic import EngineSpec, PoolManager
from treepo_ray.runtime.fault_config import FaultConfig
from treepo_ray.runtime.faults import LearnerWatch, ResilientVerifierPool, kill_actor, save_checkpoint_or_report
from treepo_ray.runtime.pipeline import Pipeline, PromptStream
from treepo_ray.runtime.registry import RuntimeRegistry, VerifierFront
from treepo_ray.runtime.train import load_task, main as train_main

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # synthetic task files, written once


def small(tiny, *extra):
    """4 prompts x 4 paths of at most 2 x 8 tokens per step; two engines of half a CPU each (room for one
    replacement as soon as one dies), the learner on the other CPU."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=4",
            "rollout.treepo.width=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.wandb=false", "runtime.num_engines=2",
            "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "algo.dynamic_sampling=false", *extra]


def kill_a_busy_engine(pipe, how: str) -> bool:
    """Kill an engine while it has sequences running (mid-segment); True if one was caught busy."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = [s["engine_id"] for s in pipe.pool.stats() if s["running"] > 0]
        if busy:
            victim = next(e for e in pipe.pool.engines if e._actor_id.hex() == busy[0])
            kill_actor(victim, how)
            return True
        time.sleep(0.005)
    return False


def full_trees(batch, metrics, width=4, prompts=4):
    """Every prompt of the step came back with its full set of finished trajectories."""
    return (metrics["train/samples"] == width * prompts and len(batch.trees) == prompts
            and all(len(t["trajectories"]) == width for t in batch.trees))


def test_engines_killed_mid_segment_change_nothing_but_wall_time(ray_local, tiny):
    # A negligible learning rate keeps the weights as they are, so the same prompts (same seeds) must give the
    # same trees in a run without faults and in one where engines die under them.
    cfg = config_io.load(TrainConfig, DEFAULT_CONFIG, small(tiny, "learner.lr=1e-30"))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    records, _ = load_task(cfg, tokenizer)
    pipe = Pipeline(cfg, tiny, tokenizer)
    clean, faulty, caught = [], [], []
    kills = {3: "ray", 4: "signal"}  # after these steps are trained, the producer is growing the next batch

    def on_faulty_step(batch, metrics):
        faulty.append((batch, metrics))
        if batch.step in kills:
            caught.append(kill_a_busy_engine(pipe, kills[batch.step]))
        return True

    try:
        assert pipe.train(0, 3, PromptStream(records, 0), lambda b, m: clean.append((b, m)) or True, 4) == 3
        assert pipe.train(3, 6, PromptStream(records, 0), on_faulty_step, 4) == 6
        deadline = time.monotonic() + 60
        while (pipe.generators.lost, pipe.generators.size) != (2, 2) and time.monotonic() < deadline:
            time.sleep(0.2)  # both losses noticed, both replacements joined
        assert pipe.generators.size == 2 and pipe.generators.lost == 2 and pipe.generators.joined == 4
        tail = pipe.fault_metrics()
    finally:
        pipe.shutdown()

    assert caught == [True, True]
    # Every step trained once, in order, on full trees (learner version = steps trained).
    assert [b.step for b, _ in clean + faulty] == list(range(6))
    assert [m["train/version"] for _, m in clean + faulty] == [1, 2, 3, 4, 5, 6]
    assert all(full_trees(b, m) for b, m in clean + faulty)
    faults = {}
    for key in ("fault/resent_requests", "fault/engines_lost"):
        faults[key] = sum(m.get(key, 0.0) for _, m in faulty) + tail.get(key, 0.0)
    assert faults["fault/resent_requests"] >= 2 and faults["fault/engines_lost"] == 2
    # Same prompts, same seeds, same weights: the same trees, token for token, and the same rewards. Every
    # segment came from the weights the pool ran for that batch (a replacement loaded them before joining).
    for (b0, _), (b1, _) in zip(clean, faulty):
        assert [t["tokens"] for t in b0.trees] == [t["tokens"] for t in b1.trees]
        assert [t["reward"] for t in b0.trees] == [t["reward"] for t in b1.trees]
        assert all(t["meta"]["weights_version"] == b1.version for t in b1.trees)


def test_train_survives_engine_chaos_and_a_lost_learner(ray_local, tiny, tmp_path):
    run = tmp_path / "run"
    args = small(tiny, f"trainer.run_dir={run}", "trainer.steps=4", "trainer.save_every=2", "log.trees_per_step=4",
                 "runtime.chaos.kill_generator_every=2", "runtime.chaos.kill_learner_after_step=3")
    assert train_main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    faults = summary["faults"]
    # The learner died after step 3 (checkpoint at step 2): rebuilt once, step 3 trained again.
    assert faults["fault/learner_restarts"] == 1 and faults["fault/steps_redone"] == 1
    assert faults["fault/chaos_kills"] >= 2 and faults["fault/engines_lost"] >= 1  # >= 1 engine + the learner
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/version" in r]
    assert steps == [1, 2, 3, 3, 4]  # the honest log: step 3 twice, once per learner that trained it
    # No step is trained twice by the learner whose weights the run ends with: each logged step's version is
    # the step (the rebuilt learner loaded version 2 and trained steps 3 and 4).
    assert all(r["train/version"] == r["step"] for r in rows if "train/version" in r)
    assert all(r["train/samples"] == 16 for r in rows if "train/samples" in r)
    # The prompt stream was rewound to the checkpoint's data position: step 3 saw the same prompts both times.
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    step3 = [t["query_id"] for t in trees if t["step"] == 3]
    assert len(step3) == 8 and step3[:4] == step3[4:]
    assert all(len(t["trajectories"]) == 4 for t in trees)
    assert [s for s, _ in list_checkpoints(run)] == [2, 4]


def test_verifier_loss_retries_and_timeouts_score_failures(ray_local):
    registry = RuntimeRegistry.remote()
    pool = ResilientVerifierPool.start(2, 0, 5.0, registry, FaultConfig(verifier_retries=1))
    items = [(DATA_SOURCE, "12 + 30 = 42\n\\boxed{42}", "42"), (DATA_SOURCE, "\\boxed{41}", "42")]
    try:
        assert ray.get(pool.score(items)) == [1.0, 0.0]
        # The verifier the next call goes to dies (SIGKILL of its process): the call is retried on the other one,
        # and the dead one is restarted in place by Ray (verifiers hold no state).
        kill_actor(pool.verifiers[1], "signal")
        assert ray.get(pool.score(items)) == [1.0, 0.0]
        assert ray.get(pool.score(items)) == [1.0, 0.0]  # round robin reaches the restarted one (or waits for it)
        kinds = [k for _, k, _, _ in ray.get(registry.drain.remote())]
        assert kinds and set(kinds) == {"verifier_retries"}  # retried, never failed
        # A call longer than the limit (a tower sympy tries to expand; the verifier's own per-item deadline is 5 s):
        # retried once, then the items score as failures with the reason logged; the hung verifiers are restarted.
        impatient = VerifierFront.remote(pool.verifiers, registry, 1, 1.0, -1.0)
        hard = [("math", r"\boxed{10^{10^{10}}}", "5"), items[0]]
        assert ray.get(impatient.score.remote(hard)) == [-1.0, -1.0]
        events = ray.get(registry.drain.remote())
        assert [k for _, k, _, _ in events] == ["verifier_retries", "verifier_failures"]
        assert "timed out after 1s" in events[-1][2] and events[-1][3] == 2
        ray.kill(impatient)
        assert ray.get(pool.score(items), timeout=60) == [1.0, 0.0]  # the timed-out verifiers came back
    finally:
        for actor in pool.actors() + [registry]:
            ray.kill(actor)


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

    group = LearnerGroup(tiny, LearnerConfig(lr=1e-3, micro_batch_size=4), world_size=1, num_cpus=0)
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    try:
        ray.get(group.train_step(ray.put(samples)))
        assert save_checkpoint_or_report(group, checkpoint_dir(full_disk, 1), {"step": 1, "data_position": 4}) is None
        if mounted:
            fill(full_disk)
        else:  # the learner process may write no file past 4 kB any more
            ray.get(group.ranks[0].__ray_call__.remote(limit_file_size, 4096))
        error = save_checkpoint_or_report(group, checkpoint_dir(full_disk, 2), {"step": 2, "data_position": 8})
        assert error is not None and "checkpoint-00000002" in error
        assert ("No space left" if mounted else "File too large") in error, error
        assert [s for s, _ in list_checkpoints(full_disk)] == [1]
        # Nothing half-written under a real name. (A write that fails inside safetensors, as with EFBIG, leaves
        # the hidden temporary folder behind: the learner's error guard does not catch SafetensorError; the next
        # successful save's pruning removes it, checked below.)
        assert [p.name for p in full_disk.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-00000001"]
        # Training goes on, and the checkpoint kept is whole.
        assert ray.get(group.train_step(ray.put(samples)))["version"] == 2
        assert group.load_checkpoint(str(checkpoint_dir(full_disk, 1)))["step"] == 1
        # Room again: the next checkpoint is written, and pruning leaves only it.
        if mounted:
            (full_disk / "filler").unlink()
        else:
            ray.get(group.ranks[0].__ray_call__.remote(limit_file_size, None))
        assert save_checkpoint_or_report(group, checkpoint_dir(full_disk, 3), {"step": 3, "data_position": 12}) is None
        prune_checkpoints(full_disk, keep=1)
        assert sorted(p.name for p in full_disk.iterdir()) == ["checkpoint-00000003"]
        # A NaN loss: the step is skipped, the weights stay as they were.
        before = ray.get(group.export_weights())
        bad = samples[:1] + [TrainSample([5, 6, 7], [9, 9, 10], advantages=float("nan"))] + samples[2:]
        metrics = ray.get(group.train_step(ray.put(bad)))
        assert metrics["skipped"] == 1
        after = ray.get(group.export_weights())
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        for r in group.ranks:
            ray.kill(r)
        os.sync()


def test_a_lost_rank_takes_its_learner_group_down_instead_of_hanging(ray_local, tiny):
    registry = RuntimeRegistry.remote()
    group = LearnerGroup(tiny, LearnerConfig(lr=1e-3, micro_batch_size=2), world_size=2, num_cpus=0)
    watch = LearnerWatch(lambda: group, registry, poll_s=0.2).start()
    samples = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
    try:
        assert ray.get(group.train_step(ray.put(samples)))["version"] == 1  # a healthy, busy group is left alone
        assert watch.takedowns == 0
        pid1, _ = ray.get(group.ranks[1].__ray_call__.remote(lambda _: (os.getpid(), None)))
        step = group.train_step(ray.put(samples))
        os.kill(pid1, 9)  # rank 1 dies in the step
        # Rank 0's step fails: gloo notices the dead peer itself (a RuntimeError), and where a backend would wait
        # (NCCL, until its timeout) the watch kills rank 0 (a RayActorError). Either way the driver is not stuck,
        # and the whole group goes, so that nothing half-alive is reused.
        start = time.monotonic()
        with pytest.raises((ray.exceptions.RayActorError, RuntimeError)):
            ray.get(step, timeout=60)
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 10
        while watch.takedowns == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.takedowns == 1
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.ranks[0].__ray_call__.remote(lambda _: 1), timeout=30)
        assert [k for _, k, _, _ in ray.get(registry.drain.remote())] == ["learner_takedowns"]
    finally:
        watch.stop()
        for actor in group.ranks + [registry]:
            ray.kill(actor)


def test_an_engine_that_cannot_start_fails_the_run_at_once(ray_local, tmp_path):
    # A bad engine config is not a lost node: no endless replacements, the engine's own error instead.
    spec = EngineSpec("hf", str(tmp_path / "no-model-here"), num_cpus=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)could not start.*no-model-here' is not a directory"):
        PoolManager(spec, num_engines=1, startup_timeout_s=120)
    assert time.monotonic() - start < 60
