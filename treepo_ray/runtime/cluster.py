"""The Ray a run joins, and what every step exports to it.

    init_ray     the configured cluster (runtime.address or RAY_ADDRESS), else a new local Ray, closed: on 127.0.0.1
                 only, with Ray's token authentication; a live one is reused
    set_up       a run's inputs (job/inputs.py: checked and loaded before anything slow starts), then Ray
    ray_gauges   a RunLogger sink exporting each metric as a Ray gauge tagged with the run and the algorithm (the Ray
                 dashboard, Prometheus, the Grafana dashboard in cluster/grafana/)
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from treepo_ray.config import UserError
from treepo_ray.job.config import TrainConfig
from treepo_ray.job.inputs import Job, load_job

METRIC_TAGS = ("run", "algorithm")
"""Tags of every Ray metric, so that runs sharing a cluster (`cluster/submit.sh all`) stay separate series."""


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for a one-machine Ray (its default on macOS and Windows). Set to 0, Ray takes 127.0.0.1 as the node's
address, so every process of a local Ray (GCS, raylet, workers, agents, dashboard, metrics) listens on the loopback
interface only and no other machine can join. Ray reads it once, when `ray` is first imported."""


def init_ray(cfg: TrainConfig) -> None:
    """Join the configured cluster (runtime.address or RAY_ADDRESS), else start a local Ray; reuse a live one.

    A local Ray is closed twice over: bound to 127.0.0.1 (LOOPBACK_ENV), and with token authentication, Ray's own
    default when RAY_AUTH_MODE is unset (ray.init sets it to token and keeps the token in ~/.ray/auth_token, made if
    missing), so a process on this machine without the token is refused too. RAY_AUTH_MODE is left to Ray: set here
    after Ray was imported, the driver would not see it but the processes it starts would. A cluster's
    authentication is its own (cluster/README.md)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":  # before `import ray`: Ray reads it then
        os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return
    if address != "local":
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except ConnectionError as err:  # 'auto' with no cluster, a head that went away: one line, no traceback
            raise UserError(f"runtime.address = {address!r}: {str(err).splitlines()[0]}") from None
        return
    node_ip = ray.util.get_node_ip_address()  # the address a new local Ray would listen on
    if os.environ[LOOPBACK_ENV] == "0" and not ipaddress.ip_address(node_ip).is_loopback:
        raise RuntimeError(f"Ray was imported before init_ray set {LOOPBACK_ENV}=0, so a local Ray would listen on "
                           f"{node_ip}: set it in the environment, or import Ray after init_ray")
    ray.init(address="local", num_cpus=cfg.runtime.num_cpus or os.cpu_count(), include_dashboard=None)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """UserError when nothing answers at a `host:port` (or ray://host:port) address: Ray itself would retry the GCS
    for a minute and then raise from deep inside."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # 'auto' and other forms: Ray resolves them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise UserError(f"runtime.address = {address!r}: nothing answers at {host}:{port} "
                        f"({err.strerror or err}); is the cluster up (`ray status` on its head)?") from None


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
