"""Weight sync: how each version the learner publishes reaches the generator pool's engines, in the engines' dtype.

    broadcast      Learner rank 0 keeps the packed weights (engines/weights.py) in its memory and sends them over a
                   process group made for the one transfer (nccl between GPUs, gloo on CPU): rank 0 is the learner,
                   engine i of the pool is rank i + 1 (a tensor-parallel engine of k GPUs: ranks 1 + k i onwards, one
                   per worker, each receiving on its own GPU), and the rendezvous is a TCP store on the learner's node, at
                   the address Ray knows that node by. An engine that joins the pool later gets a transfer of its
                   own of the version the pool runs; when an engine dies mid-transfer, or stops answering past the
                   transfer's deadline, the others' transfer fails with it, and it is repeated without that one (a
                   stuck one is killed). A lost peer fails the transfer on learner rank 0, never rank 0 itself.
    object_store   Rank 0 puts the packed weights in Ray's object store as one numpy buffer: each node fetches it
                   once, and every engine on the node reads it in place (Ray hands numpy arrays out zero-copy; torch
                   tensors it would deserialise, one copy per engine actor).

Rank 0 keeps each version until the pool has moved past it, and sends from a concurrency group of its own, so a
transfer runs while the learner trains the next step. The learner group's `publish` returns a payload only once the
export is done (within its deadline), so an engine never waits on weights that a stalled learner will not finish. The
pool (pool.py) calls `deliver` to bring every live engine to a version, and an engine actor calls `load_into` when it
joins; the loop logs each sync's path and bytes (`weights/*`) and seconds (`timing_s/update_weights`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from treepo_ray.engines.weights import PackedWeights, Receiver, unpack
from treepo_ray.runtime.engine import tensor_parallel_size
from treepo_ray.job.faults import LearnerLost
from treepo_ray.job.faults import report
from treepo_ray.runtime.liveness import actor_lost, get, within


def choose_path(cfg) -> str:
    """'broadcast' or 'object_store' for a run's config (runtime.weights.path; 'auto' decides by the resources)."""
    rt, path = cfg.runtime, cfg.runtime.weights.path
    if path != "auto":
        return path
    # Whole GPUs on both sides: NCCL refuses two ranks of one group on one GPU (fractional GPUs may share one). A
    # tensor-parallel engine's workers each join the broadcast on their own GPU.
    return "broadcast" if rt.learner_gpus >= 1 and rt.engine_gpus >= 1 else "object_store"


@dataclass
class WeightSync:
    """A run's way of moving weights: the path, the engines' dtype, and the broadcast's settings."""

    path: str
    """'broadcast' or 'object_store'."""
    dtype: str
    """The dtype the engines keep their weights in; the learner exports in it."""
    backend: str
    """Broadcast backend: 'nccl' when the learner runs on a GPU, else 'gloo'."""
    bucket_bytes: int
    timeout_s: float
    """A broadcast's own deadline (runtime.weights.timeout_s)."""
    ranks_per_engine: int = 1
    """Ranks each engine takes in a broadcast: one per tensor-parallel worker (each receives on its own GPU)."""

    @classmethod
    def for_run(cls, cfg, dtype: str) -> WeightSync:
        """The run's settings; `dtype`: the one the engines run (EngineActor.describe)."""
        backend = "nccl" if cfg.runtime.learner_gpus > 0 else "gloo"
        w = cfg.runtime.weights
        tp = tensor_parallel_size(cfg.model.engine, cfg.model.engine_kwargs)
        return cls(choose_path(cfg), dtype, backend, w.bucket_mb << 20, w.timeout_s, tp)

    def describe(self) -> str:
        how = f"broadcast from learner rank 0 ({self.backend})" if self.path == "broadcast" else "the object store"
        return f"weights reach the engines in {self.dtype} by {how}"

    def publish(self, ranks: list, version: int, timeout_s: float):
        """Export `version` on every learner rank and wait for it (`timeout_s`); returns the payload the pool
        loads."""
        keep = self.path == "broadcast"
        refs = [r.publish_weights.options(num_returns=2).remote(version, self.dtype, keep) for r in ranks]
        nbytes = get([nb for nb, _ in refs], timeout_s, f"learner exporting weights v{version}")[0]
        packed = refs[0][1]
        if keep:
            return BroadcastWeights(ranks[0], version, packed, nbytes, self.backend, self.bucket_bytes, self.timeout_s,
                                    self.ranks_per_engine)
        return ObjectStoreWeights(packed, nbytes)


@dataclass
class ObjectStoreWeights:
    """One object-store copy of a version (an ObjectRef of PackedWeights with a numpy buffer)."""

    packed: object
    nbytes: int
    path = "object_store"

    def metrics(self) -> dict[str, float]:
        return {"weights/bytes": float(self.nbytes), "weights/broadcast": 0.0}

    async def load_into(self, engine, version: int) -> None:
        """On an engine actor: fetch the buffer to this node (once per node) and load views of it."""
        packed = await self.packed
        engine.load_weights(unpack(packed.specs, packed.buffer), version)


@dataclass
class BroadcastWeights:
    """A version held by learner rank 0 (`sender`), sent by broadcast."""

    sender: object
    version: int
    manifest: object
    """ObjectRef of the PackedWeights' specs (no buffer)."""
    nbytes: int
    backend: str
    bucket_bytes: int
    timeout_s: float
    ranks_per_engine: int = 1
    path = "broadcast"

    def metrics(self) -> dict[str, float]:
        return {"weights/bytes": float(self.nbytes), "weights/broadcast": 1.0}

    def deliver(self, engines: dict, version: int) -> dict[str, str]:
        """On the driver: send the weights to every engine of `engines` (id -> actor) in one group; returns the
        engines left out (id -> why: 'lost' when it died, else it is stuck and the caller kills it); the others got
        the weights. A lost learner is raised. Each try waits at most twice the broadcast's own deadline in all (its
        process group and rendezvous time out by then): an engine still receiving after that is stuck, and the
        transfer is repeated without it, as without a dead one."""
        wait_s = 2 * self.timeout_s
        manifest = get(self.manifest, wait_s, f"learner rank 0 (manifest of weights v{version})")
        live, left_out = dict(engines), {}
        k = self.ranks_per_engine
        while live:
            world = 1 + k * len(live)
            address, port = get(self.sender.open_weights_transfer.remote(version, world, self.timeout_s), wait_s,
                                "learner rank 0 (opening a weight transfer)")
            send = self.sender.send_weights.remote(version, port, world, self.backend, self.bucket_bytes,
                                                   self.timeout_s)
            calls = {eid: actor.load_weights.remote(Slot(self.receiver(manifest, address, port, 1 + k * i, world)),
                                                    version)
                     for i, (eid, actor) in enumerate(live.items())}
            deadline = time.monotonic() + wait_s
            failed, errors = {}, []
            try:  # the sender first: a lost learner is raised at once (its receivers time out on their own)
                get(send, wait_s, f"learner rank 0 (broadcasting weights v{version})")
            except RayActorError as err:
                if actor_lost(err):
                    raise LearnerLost(f"learner rank 0 lost while broadcasting weights v{version}") from None
                errors.append(err)
            except Exception as err:  # noqa: BLE001 - a receiver's death fails the whole group's transfer
                errors.append(err)
            done, _ = ray.wait(list(calls.values()), num_returns=len(calls),
                               timeout=max(0.0, deadline - time.monotonic()))
            for eid, ref in calls.items():
                if ref not in done:
                    failed[eid] = f"not done within {wait_s:g}s (twice runtime.weights.timeout_s)"
                    continue
                try:
                    ray.get(ref)
                except RayActorError as err:
                    if actor_lost(err):
                        failed[eid] = "lost"
                    else:
                        errors.append(err)
                except Exception as err:  # noqa: BLE001
                    errors.append(err)
            if not failed:
                if errors:
                    raise errors[0]
                self.sender.forget_weights_before.remote(version)  # the pool and every joiner now want >= version
                return left_out
            report(f"weights v{version}: {len(failed)} engine(s) lost or stuck during the broadcast; sending again "
                   f"to the other {len(live) - len(failed)}")
            left_out.update(failed)
            for eid in failed:
                del live[eid]
        return left_out

    async def load_into(self, engine, version: int) -> None:
        """On an engine actor that joins the pool: a transfer of its own from the sender (the sender and the
        engine's ranks)."""
        manifest = await self.manifest
        world = 1 + self.ranks_per_engine
        address, port = await self.sender.open_weights_transfer.remote(version, world, self.timeout_s)
        send = self.sender.send_weights.remote(version, port, world, self.backend, self.bucket_bytes, self.timeout_s)
        receive_into(engine, self.receiver(manifest, address, port, 1, world), version)
        await within(send, 2 * self.timeout_s, f"learner rank 0 (sending weights v{version} to a joining engine)")

    def receiver(self, manifest: PackedWeights, address: str, port: int, rank: int, world_size: int) -> Receiver:
        return Receiver(manifest, address, port, rank, world_size, self.backend, self.bucket_bytes, self.timeout_s)


@dataclass
class Slot:
    """One engine's place in a broadcast the driver started (BroadcastWeights.deliver)."""

    receiver: Receiver

    async def load_into(self, engine, version: int) -> None:
        receive_into(engine, self.receiver, version)


def receive_into(engine, receiver: Receiver, version: int) -> None:
    """Join a transfer and load what arrives into `engine`: a tensor-parallel vLLM engine's workers each join and
    load on their own GPU; else bucket by bucket into an engine that takes a stream of (name, tensor) pairs (vLLM:
    no second copy of the model on its GPU), or as one dict."""
    if getattr(engine, "weight_receivers", 1) > 1:
        engine.load_weights_from(receiver, version)
        return
    pairs = receiver.pairs()
    try:
        engine.load_weights(pairs if engine.loads_weight_stream else dict(pairs), version)
    finally:
        pairs.close()  # after a failed load: the rest drained (the engine refuses half-loaded weights), group closed


def sync_metrics(weights) -> dict[str, float]:
    """A weight sync's figures besides its seconds (timing_s/update_weights): bytes sent to each engine (0 when the
    engines were up to date) and whether by broadcast (1) or the object store (0)."""
    return weights.metrics() if weights is not None else {"weights/bytes": 0.0}
