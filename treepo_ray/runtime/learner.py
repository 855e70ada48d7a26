"""The learner group: learner ranks (learner/) as Ray actors, joined by torch.distributed (gloo on CPU, nccl on GPU),
acting as one learner. It also holds the newest weights it published for the generators.
"""

from __future__ import annotations

import socket

import ray

from treepo_ray.runtime.engine import limit_threads


@ray.remote
class LearnerActor:
    """One rank of the learner."""

    def __init__(self, rank: int, world_size: int, torch_threads: int = 1):
        limit_threads(torch_threads)
        self.rank, self.world_size = rank, world_size
        self.learner = None

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

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return str(self.learner.save_checkpoint(directory, trainer_state))

    def load_checkpoint(self, directory: str) -> dict:
        return self.learner.load_checkpoint(directory)

    def version(self) -> int:
        return self.learner.version


class LearnerGroup:
    """`world_size` learner ranks acting as one learner; every call goes to all ranks, rank 0's answer returned."""

    def __init__(self, model_path: str, cfg, world_size: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 resources: dict | None = None, torch_threads: int = 1):
        opts = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None)
        self.ranks = [LearnerActor.options(**opts).remote(r, world_size, torch_threads) for r in range(world_size)]
        addr, port = ray.get(self.ranks[0].rendezvous.remote())
        ray.get([r.setup.remote(model_path, cfg, addr, port) for r in self.ranks])
        self.published: tuple[int, object] = (0, None)
        """The newest weights exported for the generators: (version, ObjectRef); (0, None) before the first."""

    def publish(self, version: int) -> None:
        """Export the current weights as `version` (one object-store copy; the pool loads it when a batch needs
        it). One assignment, so a reader in another thread sees the old or the new pair, never half of each."""
        self.published = (version, self.export_weights())

    def train_step(self, samples_ref) -> dict:
        """Start one step on every rank (`samples_ref`: an ObjectRef of the whole batch, TrainTree or TrainSample
        items); returns rank 0's ref."""
        return [r.train_step.remote(samples_ref) for r in self.ranks][0]

    def export_weights(self):
        """ObjectRef of the full weights (rank 0 gathers them; every rank must take part)."""
        return [r.export_weights.remote() for r in self.ranks][0]

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return ray.get([r.save_checkpoint.remote(directory, trainer_state) for r in self.ranks])[0]

    def load_checkpoint(self, directory: str) -> dict:
        return ray.get([r.load_checkpoint.remote(directory) for r in self.ranks])[0]
