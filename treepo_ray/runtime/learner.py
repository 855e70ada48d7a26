"""The learner group: learner ranks (learner/) as Ray actors, joined by torch.distributed (gloo on CPU, nccl on GPU),
acting as one learner. It also holds the newest weights it published for the generators (how they travel:
weights.py; rank 0 sends broadcasts from a concurrency group of its own, so a transfer overlaps training).
"""

from __future__ import annotations

import socket

import threading
import weakref

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treepo_ray.job.config import DeadlineConfig
from treepo_ray.runtime.engine import limit_threads, release_placement
from treepo_ray.runtime.liveness import DeadlineExceeded, get, started
from treepo_ray.runtime.weights import ObjectStoreWeights, WeightSync


@ray.remote(concurrency_groups={"weights": 1})
class LearnerActor:
    """One rank of the learner."""

    def __init__(self, rank: int, world_size: int, torch_threads: int = 1):
        limit_threads(torch_threads)
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self._held: dict[int, object] = {}  # rank 0, broadcast: version -> PackedWeights an engine may still ask for
        self._spare: list = []  # rank 0, broadcast: buffers of forgotten versions, reused by the next export
        self._stores: dict[int, object] = {}  # port -> the rendezvous store of a transfer about to start
        self._lock = threading.Lock()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 picks the address and a free port of the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, model_path: str, cfg, master_addr: str, master_port: int) -> int:
        from treepo_ray.learner import Learner

        self.learner = Learner(model_path, cfg, self.rank, self.world_size, master_addr, master_port)
        return self.learner.version

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
        finally:
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

    def version(self) -> int:
        return self.learner.version


class LearnerGroup:
    """`world_size` learner ranks acting as one learner; every call goes to all ranks, rank 0's answer returned.

    The ranks are placed as one placement group, one bundle per rank (its CPUs, its GPU, its custom resources),
    packed on as few nodes as possible: ranks that can share a node's NVLink do, and the group is placed whole or
    not at all (a pending group is one demand an autoscaler answers). `close()` gives the resources back."""

    def __init__(self, model_path: str, cfg, world_size: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 resources: dict | None = None, torch_threads: int = 1, weights: WeightSync | None = None,
                 deadlines: DeadlineConfig | None = None):
        bundle = {k: float(v) for k, v in {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}.items() if v}
        self.placement = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK") if bundle \
            else None
        """Bundle i holds rank i (None when the ranks ask for no resources at all)."""
        # Ray ends the actors of a dropped group, not its placement group: that goes with the group object.
        self._release = weakref.finalize(self, release_placement, self.placement)
        self.deadlines = dl = deadlines or DeadlineConfig()
        opts = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None)
        self.ranks = [LearnerActor.options(**opts, scheduling_strategy=self._bundle(r)).remote(r, world_size,
                                                                                              torch_threads)
                      for r in range(world_size)]
        try:
            asks = {k: v for k, v in {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}.items() if v}
            started([(f"learner rank {r}", rank, asks) for r, rank in enumerate(self.ranks)], dl.start_s)
            addr, port = get(self.ranks[0].rendezvous.remote(), dl.call_s, "learner rank 0 (rendezvous)")
            get([r.setup.remote(model_path, cfg, addr, port) for r in self.ranks], dl.start_s,
                "learner ranks loading the model")
        except BaseException:
            self.close()  # pending ranks too: no demand left behind for an autoscaler to chase
            raise
        self.weights = weights or WeightSync()
        """How published weights reach the engines (path, the engines' dtype); default: object store, float32."""
        self.published: tuple[int, object] = (0, None)
        """The newest weights exported for the generators: (version, payload of weights.py); (0, None) before the
        first."""

    def _bundle(self, rank: int):
        if self.placement is None:
            return None
        return PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)

    def close(self) -> None:
        """Kill every rank and release the placement group (a rebuilt group needs its room)."""
        for rank in self.ranks:
            ray.kill(rank)
        self._release()

    def publish(self, version: int) -> None:
        """Export the current weights as `version` in the engines' dtype (the pool loads them when a batch needs
        them). One assignment, so a reader in another thread sees the old or the new pair, never half of each."""
        self.published = (version, self.weights.publish(self.ranks, version))

    def train_step(self, samples_ref) -> dict:
        """Start one step on every rank (`samples_ref`: an ObjectRef of the whole batch, TrainTree or TrainSample
        items); returns rank 0's ref."""
        return [r.train_step.remote(samples_ref) for r in self.ranks][0]

    def export_weights(self):
        """ObjectRef of the full weights (rank 0 gathers them; every rank must take part)."""
        return [r.export_weights.remote() for r in self.ranks][0]

    def kept_copy(self):
        """The newest published weights as something the generator pool can load after this group is gone: an
        object-store version as it is, a broadcast one (held by rank 0) exported whole. Waited for: exports run
        asynchronously, and closing the group under one would lose it."""
        _, weights = self.published
        if isinstance(weights, ObjectStoreWeights):
            ref = weights.packed
        else:
            weights = ref = self.export_weights()
        done, _ = ray.wait([ref], timeout=self.deadlines.call_s, fetch_local=False)
        if not done:
            raise DeadlineExceeded(f"learner exporting weights: not done within {self.deadlines.call_s:g}s "
                                   "(runtime.deadlines.call_s)")
        return weights

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        refs = [r.save_checkpoint.remote(directory, trainer_state) for r in self.ranks]
        return get(refs, self.deadlines.checkpoint_s, f"learner saving {directory}")[0]

    def load_checkpoint(self, directory: str) -> dict:
        refs = [r.load_checkpoint.remote(directory) for r in self.ranks]
        return get(refs, self.deadlines.checkpoint_s, f"learner loading {directory}")[0]
