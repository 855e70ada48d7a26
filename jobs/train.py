"""Entry point of the training job for `ray job submit` (see jobs/README.md).

    ray job submit --runtime-env jobs/runtime_env.yaml --working-dir . -- python jobs/train.py [config.yaml] [key=value ...]

Inside a Ray job RAY_ADDRESS is set, so the run joins the cluster that runs the job instead of starting one.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # The job's working directory is a copy of the repository: make its package importable without installing it.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from treepo_ray.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
