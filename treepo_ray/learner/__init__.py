"""Layer 4: the training step (policy loss on a Hugging Face causal LM, FSDP2 across ranks), weight export and
checkpoints. Usable from a plain Python process; the Ray actors that wrap it live in treepo_ray/runtime/."""

from treepo_ray.learner.batch import TrainSample, TrainTree, shard_trees, train_trees
from treepo_ray.learner.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints, prune_checkpoints
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.learner.learner import Learner

__all__ = [
    "Learner",
    "LearnerConfig",
    "TrainSample",
    "TrainTree",
    "checkpoint_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "shard_trees",
    "train_trees",
]
