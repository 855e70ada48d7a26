"""Layer 4: datasets and prompts, the synthetic task, test-time sampling, the tiny base model's pretraining,
evaluation metrics.

The package exports the light modules' names (no torch): the loaders and the synthetic task. Pretraining
(treepo_ray.data.pretrain, which imports torch) and the eval command (treepo_ray.data.evaluate) are imported by
their module path.
"""

from treepo_ray.data.datasets import (DataConfig, DatasetConfig, LoadedDataset, load_dataset, load_records,
                                      synthetic_files)
from treepo_ray.data.synthetic import SyntheticTaskConfig, make_problems, write_splits

__all__ = ["DataConfig", "DatasetConfig", "LoadedDataset", "SyntheticTaskConfig", "load_dataset", "load_records",
           "make_problems", "synthetic_files", "write_splits"]
