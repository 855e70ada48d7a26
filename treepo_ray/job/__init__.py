"""Layer 4b: the training job as plain Python (no Ray): its configuration, the trainer's state, and the run
directory's files (metrics, trees, training curve, the tree viewer)."""
