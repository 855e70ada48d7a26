"""treepo-ray: Ray-native RL post-training of language models with segment-tree rollouts."""

__version__ = "0.1.0"
