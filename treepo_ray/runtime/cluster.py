"""The Ray a run joins, and what every step exports to it.

    init_ray     the configured cluster (runtime.address or RAY_ADDRESS), else a new local Ray; a live one is reused
    set_up       a run's inputs (job/inputs.py: checked and loaded before anything slow starts), then Ray
    ray_gauges   a RunLogger sink exporting each metric as a Ray gauge tagged with the run and the algorithm (the Ray
                 dashboard, Prometheus, the Grafana dashboard in cluster/grafana/)
"""

from __future__ import annotations

import os
import re

from treepo_ray.job.config import TrainConfig
from treepo_ray.job.inputs import Job, load_job

METRIC_TAGS = ("run", "algorithm")
"""Tags of every Ray metric, so that runs sharing a cluster (`cluster/submit.sh all`) stay separate series."""


def init_ray(cfg: TrainConfig) -> None:
    """Join the configured cluster (runtime.address or RAY_ADDRESS), else start a local Ray; reuse a live one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=cfg.runtime.num_cpus or os.cpu_count(), include_dashboard=None)


def set_up(cfg: TrainConfig) -> Job:
    """The model (the tiny base model is built first, before Ray: it uses every core), its tokenizer, the task's
    prompts, and Ray. A mistake in the inputs is a UserError before anything slow starts."""
    job = load_job(cfg)
    init_ray(cfg)
    return job


def gauge_name(key: str) -> str:
    """The Ray metric of a metric key: `treepo_` + the key with every character outside [a-zA-Z0-9_] as `_`
    (Prometheus names; Ray's exporter adds its own `ray_` prefix: critic/score/mean -> ray_treepo_critic_score_mean)."""
    return "treepo_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def ray_gauges(run: str, algorithm: str):
    """A RunLogger sink exporting each metric as a ray.util.metrics Gauge tagged with the run and the algorithm."""
    from ray.util.metrics import Gauge

    gauges: dict = {}
    tags = {"run": run, "algorithm": algorithm}

    def sink(step: int, values: dict) -> None:
        for key, v in values.items():
            name = gauge_name(key)
            if name not in gauges:
                gauges[name] = Gauge(name, description=key, tag_keys=METRIC_TAGS)
                gauges[name].set_default_tags(tags)
            gauges[name].set(v)

    return sink
