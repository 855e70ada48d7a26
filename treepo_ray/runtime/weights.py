"""Weight sync: how each version the learner publishes reaches the generator pool's engines, in the engines' dtype.

    broadcast      Learner rank 0 keeps the packed weights (engines/weights.py) in its memory and sends them over a
                   process group made for the one transfer (nccl between GPUs, gloo on CPU): rank 0 is the learner,
                   engine i of the pool is rank i + 1, and the rendezvous is a TCP store on the learner's node, at
                   the address Ray knows that node by. An engine that joins the pool later gets a transfer of its
                   own (a group of two) of the version the pool runs; when an engine dies mid-transfer the others'
                   transfer fails with it, and it is repeated without the dead one.
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

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from ray.exceptions import RayActorError

from treepo_ray.engines.weights import Broadcast, PackedWeights, unpack
from treepo_ray.runtime.engine import tensor_parallel_size
from treepo_ray.job.faults import LearnerLost
from treepo_ray.job.faults import report
from treepo_ray.runtime.liveness import actor_lost, get


def choose_path(cfg) -> str:
    """'broadcast' or 'object_store' for a run's config (runtime.weights.path; 'auto' decides by the resources)."""
    rt, path = cfg.runtime, cfg.runtime.weights.path
    tp = tensor_parallel_size(cfg.model.engine, cfg.model.engine_kwargs)
    if path == "broadcast" and tp > 1:
        raise ValueError("runtime.weights.path = broadcast, but the engines run tensor_parallel_size = "
                         f"{tp} (their weights live in vLLM's worker processes): use object_store")
    if path != "auto":
        return path
    # Whole GPUs on both sides: NCCL refuses two ranks of one group on one GPU (fractional GPUs may share one).
    return "broadcast" if rt.learner_gpus >= 1 and rt.engine_gpus >= 1 and tp == 1 else "object_store"


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

    @classmethod
    def for_run(cls, cfg, dtype: str) -> WeightSync:
        """The run's settings; `dtype`: the one the engines run (EngineActor.describe)."""
        backend = "nccl" if cfg.runtime.learner_gpus > 0 else "gloo"
        w = cfg.runtime.weights
        return cls(choose_path(cfg), dtype, backend, w.bucket_mb << 20, w.timeout_s)

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
            return BroadcastWeights(ranks[0], version, packed, nbytes, self.backend, self.bucket_bytes, self.timeout_s)
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
    path = "broadcast"

    def metrics(self) -> dict[str, float]:
        return {"weights/bytes": float(self.nbytes), "weights/broadcast": 1.0}

    def deliver(self, engines: dict, version: int) -> list[str]:
        """On the driver: send the weights to every engine of `engines` (id -> actor) in one group; returns the ids
        of engines that died meanwhile (the others got the weights). A lost learner is raised. Every wait is bounded
        by the broadcast's own deadline (its process group and rendezvous time out by then) plus that again."""
        wait_s = 2 * self.timeout_s
        manifest = get(self.manifest, wait_s, f"learner rank 0 (manifest of weights v{version})")
        live, lost = dict(engines), []
        while live:
            world = len(live) + 1
            address, port = get(self.sender.open_weights_transfer.remote(version, world, self.timeout_s), wait_s,
                                "learner rank 0 (opening a weight transfer)")
            send = self.sender.send_weights.remote(version, port, world, self.backend, self.bucket_bytes,
                                                   self.timeout_s)
            calls = {eid: actor.load_weights.remote(Slot(self, manifest, address, port, rank, world), version)
                     for rank, (eid, actor) in enumerate(live.items(), start=1)}
            dead, errors = [], []
            try:  # the sender first: a lost learner is raised at once (its receivers time out on their own)
                get(send, wait_s, f"learner rank 0 (broadcasting weights v{version})")
            except RayActorError as err:
                if actor_lost(err):
                    raise LearnerLost(f"learner rank 0 lost while broadcasting weights v{version}") from None
                errors.append(err)
            except Exception as err:  # noqa: BLE001 - a receiver's death fails the whole group's transfer
                errors.append(err)
            for eid, ref in calls.items():
                try:
                    get(ref, wait_s, f"engine {eid[:8]} (receiving weights v{version})")
                except RayActorError as err:
                    if actor_lost(err):
                        dead.append(eid)
                    else:
                        errors.append(err)
                except Exception as err:  # noqa: BLE001
                    errors.append(err)
            if not dead:
                if errors:
                    raise errors[0]
                self.sender.forget_weights_before.remote(version)  # the pool and every joiner now want >= version
                return lost
            report(f"weights v{version}: {len(dead)} engine(s) died during the broadcast; sending again to the "
                   f"other {len(live) - len(dead)}")
            lost += dead
            for eid in dead:
                del live[eid]
        return lost

    async def load_into(self, engine, version: int) -> None:
        """On an engine actor that joins the pool: a transfer of its own from the sender (a group of two)."""
        manifest = await self.manifest
        address, port = await self.sender.open_weights_transfer.remote(version, 2, self.timeout_s)
        send = self.sender.send_weights.remote(version, port, 2, self.backend, self.bucket_bytes, self.timeout_s)
        receive_into(engine, manifest, address, port, 1, 2, self, version)
        await send


@dataclass
class Slot:
    """One engine's place in a broadcast the driver started (BroadcastWeights.deliver)."""

    weights: BroadcastWeights
    manifest: PackedWeights
    address: str
    port: int
    rank: int
    world_size: int

    async def load_into(self, engine, version: int) -> None:
        receive_into(engine, self.manifest, self.address, self.port, self.rank, self.world_size, self.weights,
                     version)


def receive_into(engine, manifest: PackedWeights, address: str, port: int, rank: int, world_size: int,
                 weights: BroadcastWeights, version: int) -> None:
    """Join a transfer as `rank` and load what arrives into `engine`: bucket by bucket into an engine that takes a
    stream of (name, tensor) pairs (vLLM: no second copy of the model on its GPU), else as one dict."""
    store = dist.TCPStore(address, port, world_size, False, timedelta(seconds=weights.timeout_s))
    group = Broadcast(store, rank, world_size, weights.backend, weights.timeout_s)
    try:
        pairs = group.receive(manifest, weights.bucket_bytes)
        try:
            engine.load_weights(pairs if engine.loads_weight_stream else dict(pairs), version)
        except BaseException:
            try:  # let the sender and the other receivers finish; the engine refuses to run half-loaded weights
                group.drain()
            except Exception:  # noqa: BLE001 - the group itself failed: nothing left to drain
                pass
            raise
    finally:
        group.close()


def sync_metrics(weights) -> dict[str, float]:
    """A weight sync's figures besides its seconds (timing_s/update_weights): bytes sent to each engine (0 when the
    engines were up to date) and whether by broadcast (1) or the object store (0)."""
    return weights.metrics() if weights is not None else {"weights/bytes": 0.0}
