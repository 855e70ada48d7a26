"""The learner group: learner ranks (learner/) as Ray actors, joined by torch.distributed (gloo on CPU, nccl on GPU),
acting as one learner; every call on it has a deadline (runtime.deadlines), and a call that fails because a rank was
lost or stopped answering raises LearnerLost, which the trainer answers by rebuilding the group from the newest
checkpoint (job/trainer.py; the rebuilding itself is the supervisor's: supervisor.py). How the weights it publishes
reach the engines: weights.py (rank 0 sends broadcasts from a concurrency group of its own, so a transfer overlaps
training).
"""

from __future__ import annotations

import os
import socket
import threading
import weakref

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treepo_ray import storage
from treepo_ray.config import UserError
from treepo_ray.job.faults import LearnerLost
from treepo_ray.runtime.engine import limit_threads, release_placement
from treepo_ray.runtime.liveness import DeadlineExceeded, actor_lost, brief, get, started
from treepo_ray.runtime.weights import ObjectStoreWeights, WeightSync


def _sees(_actor, location: str) -> bool:
    return storage.exists(location)


@ray.remote(concurrency_groups={"weights": 1, "health": 1})
class LearnerActor:
    """One rank of the learner."""

    def __init__(self, rank: int, world_size: int, torch_threads: int):
        limit_threads(torch_threads)
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self._held: dict[int, object] = {}  # rank 0, broadcast: version -> PackedWeights an engine may still ask for
        self._spare: list = []  # rank 0, broadcast: buffers of forgotten versions, reused by the next export
        self._stores: dict[int, object] = {}  # port -> the rendezvous store of a transfer about to start
        self._lock = threading.Lock()

    @ray.method(concurrency_group="health")
    def alive(self) -> bool:
        """The heartbeat's ping: answered beside a running step, so a rank is judged by whether it runs at all."""
        return True

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 picks the address and a free port of the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, model_path: str, cfg, master_addr: str, master_port: int) -> None:
        from treepo_ray.learner import Learner

        self.learner = Learner(model_path, cfg, self.rank, self.world_size, master_addr, master_port)

    def train_step(self, batch: list) -> dict:
        # Each rank trains on its own share of the trees (balanced by tokens); the Learner all-reduces gradients
        # and metrics.
        from treepo_ray.learner import shard_trees

        return self.learner.train_step(shard_trees(batch, self.rank, self.world_size))

    def export_weights(self) -> dict:
        return self.learner.export_weights()

    # ---- weights for the engines (weights.py); publish_weights runs on every rank, the rest on rank 0 only

    def publish_weights(self, version: int, dtype: str, keep: bool) -> tuple[int, object]:
        """Export the weights in the engines' `dtype`; rank 0 returns (bytes, PackedWeights): with `keep` (broadcast)
        it keeps the bytes and returns a manifest, else the packed numpy buffer goes to the object store."""
        from treepo_ray.learner.export import export_packed

        pin = keep and self.learner.device.type == "cuda"
        with self._lock:
            spare = self._spare.pop() if pin and self._spare else None
        packed = export_packed(self.learner.model, dtype, self.rank, pin=pin, out=spare)
        if packed is None:
            return 0, None
        if not keep:
            return packed.nbytes, packed
        with self._lock:
            self._held[version] = packed
        return packed.nbytes, packed.manifest()

    @ray.method(concurrency_group="weights")
    def open_weights_transfer(self, version: int, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Host the rendezvous of a transfer of `version` to world_size - 1 engines; returns (node address, port)."""
        from treepo_ray.engines.weights import host_store

        with self._lock:
            if version not in self._held:
                raise KeyError(f"weights v{version} are not held here (held: {sorted(self._held)})")
        store = host_store(world_size, timeout_s)
        self._stores[store.port] = store
        return ray.util.get_node_ip_address(), store.port

    @ray.method(concurrency_group="weights")
    def send_weights(self, version: int, port: int, world_size: int, backend: str, bucket_bytes: int,
                     timeout_s: float) -> int:
        """Rank 0 of the transfer opened on `port`: broadcast `version`; returns the bytes sent."""
        from treepo_ray.engines.weights import Broadcast

        store = self._stores.pop(port)
        with self._lock:
            packed = self._held[version]
        device = self.learner.device if backend == "nccl" else None
        group = Broadcast(store, 0, world_size, backend, timeout_s, device)
        try:
            group.send(packed, bucket_bytes)
        except BaseException:
            group.close(failed=True)  # a receiver lost or stuck: the exception goes to the driver, this rank lives on
            raise
        group.close()
        return packed.nbytes

    @ray.method(concurrency_group="weights")
    def forget_weights_before(self, version: int) -> None:
        with self._lock:
            for old in [v for v in self._held if v < version]:
                buffer = self._held.pop(old).buffer
                if not self._spare and getattr(buffer, "is_pinned", lambda: False)():
                    self._spare.append(buffer)  # one is enough: each publish takes one, each sync frees one

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return str(self.learner.save_checkpoint(directory, trainer_state))

    def load_checkpoint(self, directory: str) -> dict:
        return self.learner.load_checkpoint(directory)


class LearnerGroup:
    """runtime.learner_ranks learner ranks acting as one learner; every call goes to all ranks, rank 0's answer
    returned, within its deadline.

    The ranks are placed as one placement group, one bundle per rank (its CPUs, its GPU, its custom resources),
    packed on as few nodes as possible: ranks that can share a node's NVLink do, and the group is placed whole or
    not at all (a pending group is one demand an autoscaler answers). `close()` gives the resources back."""

    def __init__(self, model_path: str, cfg, rt, weights: WeightSync):
        """`cfg`: learner section; `rt`: runtime section (learner_* resources, torch_threads, deadlines)."""
        asks = {k: float(v) for k, v in {"CPU": rt.learner_cpus, "GPU": rt.learner_gpus,
                                         **rt.learner_resources}.items() if v}
        world_size = rt.learner_ranks
        self.placement = placement_group([dict(asks) for _ in range(world_size)], strategy="PACK") if asks else None
        """Bundle i holds rank i (None when the ranks ask for no resources at all)."""
        # Ray ends the actors of a dropped group, not its placement group: that goes with the group object.
        self._release = weakref.finalize(self, release_placement, self.placement)
        self.deadlines = dl = rt.deadlines
        self.weights = weights
        """How published weights reach the engines (path, the engines' dtype)."""
        opts = dict(num_cpus=rt.learner_cpus, num_gpus=rt.learner_gpus, resources=rt.learner_resources or None)
        self.ranks = [LearnerActor.options(**opts, scheduling_strategy=self._bundle(r)).remote(r, world_size,
                                                                                              rt.torch_threads)
                      for r in range(world_size)]
        try:
            started([(f"learner rank {r}", rank, asks) for r, rank in enumerate(self.ranks)], dl.start_s)
            addr, port = get(self.ranks[0].rendezvous.remote(), dl.call_s, "learner rank 0 (rendezvous)")
            get([r.setup.remote(model_path, cfg, addr, port) for r in self.ranks], dl.start_s,
                "learner ranks loading the model")
        except BaseException:
            self.close()  # pending ranks too: no demand left behind for an autoscaler to chase
            raise

    def _bundle(self, rank: int):
        if self.placement is None:
            return None
        return PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)

    def pings(self) -> dict:
        """The heartbeat's pings of the ranks (supervisor.py), by name."""
        return {f"learner rank {r}": rank.alive.remote for r, rank in enumerate(self.ranks)}

    def close(self) -> None:
        """Kill every rank and release the placement group (a rebuilt group needs its room)."""
        for rank in self.ranks:
            ray.kill(rank)
        self._release()

    def _all(self, method: str, *args, timeout_s: float):
        """`method(*args)` on every rank, rank 0's answer; LearnerLost when a rank is lost or stuck (`_lost`)."""
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        try:
            return get(refs, timeout_s, f"learner {method}")[0]
        except (DeadlineExceeded, RayActorError, RayTaskError) as err:
            raise self._lost(err) from None

    def _lost(self, err: BaseException) -> BaseException:
        """What a failed call on the ranks means: LearnerLost (the ranks killed) when a rank died or stopped
        answering, past the call's deadline or the heartbeat's (a rank that does not answer holds its peers in a
        collective; a peer's death can also fail a rank's step with an error of its own); else the error itself (a
        bad batch, a full disk)."""
        if not isinstance(err, DeadlineExceeded) and not actor_lost(err):
            try:
                get([r.alive.remote() for r in self.ranks], self.deadlines.heartbeat_s, "learner ranks (ping)")
                return err
            except (DeadlineExceeded, RayActorError):
                pass
        self.close()
        return LearnerLost(f"the learner was lost ({brief(err)}): its ranks are killed")

    def train_step(self, samples_ref) -> dict:
        """One step on every rank (`samples_ref`: an ObjectRef of the whole batch, TrainTree or TrainSample
        items); rank 0's metrics."""
        return self._all("train_step", samples_ref, timeout_s=self.deadlines.train_step_s)

    def publish(self, version: int):
        """Export the current weights as `version` in the engines' dtype, waited for; the payload the pool loads
        (weights.py)."""
        try:
            return self.weights.publish(self.ranks, version, self.deadlines.train_step_s)
        except (DeadlineExceeded, RayActorError, RayTaskError) as err:
            raise self._lost(err) from None

    def export_weights(self):
        """ObjectRef of the full weights (rank 0 gathers them; every rank must take part)."""
        return [r.export_weights.remote() for r in self.ranks][0]

    def kept_copy(self, published):
        """`published` (a payload of `publish`) as something the generator pool can load after this group is gone:
        an object-store version as it is, a broadcast one (held by rank 0) exported whole, waited for."""
        if isinstance(published, ObjectStoreWeights):
            return published
        ref = self.export_weights()
        done, _ = ray.wait([ref], timeout=self.deadlines.call_s, fetch_local=False)
        if not done:
            raise DeadlineExceeded(f"learner exporting weights: not done within {self.deadlines.call_s:g}s "
                                   "(runtime.deadlines.call_s)")
        return ref

    def check_storage(self, run_dir: str) -> None:
        """Stop at once, saying why, when the run storage is not one place for every node: the driver writes a file
        into the run directory and every rank (they write the checkpoints) must see it. A local path that is not a
        shared mount fails here on a multi-node cluster, instead of a lost learner later restarting from the base
        weights because its checkpoints are on another node's disk."""
        probe = storage.join(run_dir, f".storage-probe-{os.getpid()}")
        storage.write_text(probe, "")
        try:
            seen = get([r.__ray_call__.remote(_sees, probe) for r in self.ranks], self.deadlines.call_s,
                       "checking the run storage")
        finally:
            storage.delete(probe)
        blind = [f"learner rank {i}" for i, ok in enumerate(seen) if not ok]
        if blind:  # a setup mistake, not a fault of the run: one line and exit status 2 (cli.py)
            raise UserError(f"the run storage {run_dir} is not reachable from {', '.join(blind)}: every node must "
                             "see trainer.storage_path at the same path (a shared mount: cluster/README.md) or use "
                             "an s3:// or gs:// URI")

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return self._all("save_checkpoint", directory, trainer_state, timeout_s=self.deadlines.checkpoint_s)

    def load_checkpoint(self, directory: str) -> dict:
        return self._all("load_checkpoint", directory, timeout_s=self.deadlines.checkpoint_s)
