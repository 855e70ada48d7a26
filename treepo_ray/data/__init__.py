"""Layer 4: datasets and prompts, the synthetic task, the tiny base model's pretraining, evaluation metrics.

Names are imported on first use, so `import treepo_ray.data` stays light (no torch until pretraining is asked for).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DatasetConfig": "treepo_ray.data.datasets",
    "LoadedDataset": "treepo_ray.data.datasets",
    "load_dataset": "treepo_ray.data.datasets",
    "load_records": "treepo_ray.data.datasets",
    "synthetic_files": "treepo_ray.data.datasets",
    "SyntheticTaskConfig": "treepo_ray.data.synthetic",
    "make_problems": "treepo_ray.data.synthetic",
    "write_splits": "treepo_ray.data.synthetic",
    "PretrainConfig": "treepo_ray.data.pretrain",
    "prepare_base_model": "treepo_ray.data.pretrain",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treepo_ray.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
