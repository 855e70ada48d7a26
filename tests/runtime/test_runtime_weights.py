"""Weight sync (runtime/weights.py) between real Ray actors on a local Ray with the real tiny model: learner rank 0
broadcasts to hf engines over gloo (the calls NCCL makes on GPUs), an engine that joins after a transfer gets its own,
one that dies before a transfer is dropped and the others served; the object-store path hands every engine a
read-only (zero-copy) view of one copy in the engines' dtype; and the loop logs each sync's path and bytes."""

from __future__ import annotations

import concurrent.futures

import pytest
import ray
import torch

from treepo_ray.data.prompts import PromptStream
from treepo_ray.engines.weights import unpack
from treepo_ray.job.config import RuntimeConfig, load_config
from treepo_ray.learner import LearnerConfig, TrainSample
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import actor_id
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.weights import WeightSync, choose_path
from runtime_testlib import job, small, started, trained

SAMPLES = [TrainSample([5, 6, 7], [8 + i, 9, 10], advantages=1.0 if i % 2 else -1.0) for i in range(4)]
RT = RuntimeConfig(learner_cpus=0, engine_cpus=0)


def _engine_weights(actor) -> dict[str, torch.Tensor]:
    return ray.get(actor.__ray_call__.remote(lambda a: {k: v.clone() for k, v in a.engine.model.state_dict().items()}))


def _same(engine: dict, exported: dict) -> bool:
    return all(torch.equal(engine[k], v) for k, v in exported.items())


def _train_and_publish(group: LearnerGroup, version: int):
    """One step, published as `version`: (the payload, the exported weights)."""
    group.train_step(ray.put(SAMPLES))
    return group.publish(version), ray.get(group.export_weights())


@pytest.mark.slow
def test_broadcast_reaches_every_engine_and_follows_joins_and_losses(ray_local, tiny):
    sync = WeightSync(path="broadcast", dtype="float32", backend="gloo", bucket_bytes=64 << 10, timeout_s=5.0)
    group = LearnerGroup(tiny, LearnerConfig(lr=1e-2, micro_batch_size=2), RT, sync)
    pool = GeneratorPool(EngineSpec("hf", tiny, {}, 1, 0, 0, {}), RuntimeConfig(num_engines=2))
    try:
        # v1 to both engines in one transfer (ranks 1 and 2 of one gloo group), in buckets of 64 KiB.
        p1, v1 = _train_and_publish(group, 1)
        assert p1.path == "broadcast" and p1.metrics()["weights/broadcast"] == 1.0
        pool.load_weights(p1, 1)
        a, b = pool.members().values()
        assert _same(_engine_weights(a), v1) and _same(_engine_weights(b), v1)
        assert {s["weights_version"] for s in pool.stats()} == {1}

        # Rank 0 sends from a concurrency group of its own: a transfer runs while the learner trains.
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            long_step = threads.submit(group.train_step, ray.put(SAMPLES * 512))  # seconds, against ms for the transfer
            pool.load_weights(p1, 1)
            assert not long_step.done()  # the transfer is done, the step still running
            long_step.result()

        # One engine leaves (the supervisor drops it: here by hand); its replacement joins after that transfer and
        # gets v1 in a transfer of its own.
        ray.kill(a)
        pool.drop(actor_id(a), "killed by the test")
        while pool.size < 2:
            pool.tick(wait_s=0.2)
        joiner = next(e for e in pool.members().values() if e is not b)
        assert _same(_engine_weights(joiner), v1)
        assert ray.get(joiner.stats.remote())["weights_version"] == 1

        # v2: an engine dies after the pool last looked, so the first transfer's group never forms; it is sent
        # again to the live one, and the dead one is dropped.
        p2, v2 = _train_and_publish(group, 2)
        assert not _same(v2, v1)
        ray.kill(joiner)
        pool.load_weights(p2, 2)
        assert pool.weights_version == 2 and list(pool.members().values()) == [b]
        assert _same(_engine_weights(b), v2)
        # Rank 0 keeps only what the pool or a joiner may still ask for.
        held = ray.get(group.ranks[0].__ray_call__.remote(lambda r: sorted(r._held)))
        assert held == [2]
    finally:
        pool.close()
        group.close()


@pytest.mark.slow
def test_object_store_path_exports_in_the_engines_dtype_and_is_read_in_place(ray_local, tiny):
    sync = WeightSync(path="object_store", dtype="bfloat16", backend="gloo", bucket_bytes=1 << 20, timeout_s=60.0)
    group = LearnerGroup(tiny, LearnerConfig(lr=1e-2, micro_batch_size=2), RT, sync)
    pool = GeneratorPool(EngineSpec("hf", tiny, {}, 1, 0, 0, {}), RT)
    try:
        payload, exported = _train_and_publish(group, 1)
        packed = ray.get(payload.packed)
        assert not packed.buffer.flags.writeable  # a view of the object store's shared memory, not a copy
        weights = unpack(packed.specs, packed.buffer)
        assert {w.dtype for w in weights.values()} == {torch.bfloat16}
        assert all(torch.equal(weights[k], exported[k].to(torch.bfloat16)) for k in weights)
        assert payload.metrics() == {"weights/bytes": float(packed.nbytes), "weights/broadcast": 0.0}
        assert packed.nbytes < sum(v.numel() * 4 for v in exported.values()) / 2 + 4096  # half of float32
        pool.load_weights(payload, 1)
        (engine,) = pool.members().values()
        loaded = _engine_weights(engine)
        assert all(torch.equal(loaded[k], weights[k].float()) for k in weights)
    finally:
        pool.close()
        group.close()


def test_auto_path_broadcasts_between_whole_gpus_only():
    def path(*overrides):
        return choose_path(load_config(None, list(overrides)))

    assert path() == "object_store"  # CPU
    assert path("runtime.learner_gpus=1", "runtime.engine_gpus=1") == "broadcast"
    assert path("runtime.learner_gpus=0.5", "runtime.engine_gpus=0.5") == "object_store"  # may share one GPU
    tp2 = ["runtime.learner_gpus=1", "model.engine=vllm", "model.engine_kwargs={tensor_parallel_size: 2}"]
    assert path(*tp2, "runtime.engine_gpus=0") == "object_store"
    # A tensor-parallel engine's workers each join the broadcast on their own GPU: one rank each.
    assert path(*tp2, "runtime.engine_gpus=1") == "broadcast"
    sync = WeightSync.for_run(load_config(None, [*tp2, "runtime.engine_gpus=1"]), "bfloat16")
    assert (sync.backend, sync.ranks_per_engine) == ("nccl", 2)
    assert path("runtime.weights.path=broadcast") == "broadcast"  # gloo on CPU


@pytest.mark.slow
def test_the_loop_logs_each_syncs_path_and_bytes(ray_local, tiny):
    run = job(small(tiny, "runtime.weights.path=broadcast", "runtime.max_staleness=0"))
    rt = started(run)
    try:
        assert rt.supervisor.learner.weights.describe() == ("weights reach the engines in float32 by broadcast from "
                                                           "learner rank 0 (gloo)")
        first, second = [m for _, m in trained(rt, 0, 2, PromptStream(run.train_set, 0))]
        assert first["weights/bytes"] == 0.0 and "weights/broadcast" not in first  # nothing published before step 0
        assert second["weights/broadcast"] == 1.0 and second["weights/bytes"] > 0 and second["timing_s/update_weights"] > 0
        assert {s["weights_version"] for s in rt.supervisor.pool.stats()} == {1}
    finally:
        rt.supervisor.shutdown()


def _break_after_first_tensor(actor, how: str) -> None:
    """Make the engine behind `actor` take weights as a stream and, after the first tensor of a broadcast arrives
    (buckets still to come), exit ('die': a spot engine lost mid-transfer) or stop answering ('hang')."""
    def arm(a):
        import os
        import time

        def load_weights(pairs, version):
            next(iter(pairs))
            if how == "die":
                os._exit(1)
            time.sleep(3600)

        a.engine.loads_weight_stream = True
        a.engine.load_weights = load_weights

    ray.get(actor.__ray_call__.remote(arm))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["die", "hang"])
def test_an_engine_lost_or_stuck_mid_transfer_leaves_the_learner_and_the_other_engines_running(ray_local, tiny, how):
    sync = WeightSync(path="broadcast", dtype="float32", backend="gloo", bucket_bytes=16 << 10, timeout_s=3.0)
    group = LearnerGroup(tiny, LearnerConfig(lr=1e-2, micro_batch_size=2), RT, sync)
    pool = GeneratorPool(EngineSpec("hf", tiny, {}, 1, 0, 0, {}), RuntimeConfig(num_engines=2))
    try:
        p1, v1 = _train_and_publish(group, 1)
        broken, survivor = pool.members().values()
        _break_after_first_tensor(broken, how)
        # The transfer fails with the broken engine (a stuck one is killed past the transfer's deadline) and is
        # sent again to the survivor; the run goes on without the broken one.
        pool.load_weights(p1, 1)
        assert pool.weights_version == 1 and list(pool.members().values()) == [survivor]
        assert _same(_engine_weights(survivor), v1)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(broken.stats.remote(), timeout=30)
        # Learner rank 0 (the sender) lives on: it trains and sends the next version.
        p2, v2 = _train_and_publish(group, 2)
        pool.load_weights(p2, 2)
        assert _same(_engine_weights(survivor), v2)
    finally:
        pool.close()
        group.close()
