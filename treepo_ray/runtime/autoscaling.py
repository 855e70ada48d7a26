"""A Ray cluster with Ray's own autoscaler on this one machine (its fake multi-node provider): nodes are started and
stopped by the autoscaler as on a cloud, to rehearse the generator pool's scaling and drains (`treepo-ray bench
elastic`, tests/runtime/test_runtime_scaling_nodes.py); and the two ways a node goes away that a cloud has: a drain
announced to Ray (what `ray drain-node`, a KubeRay pre-stop hook or a spot notice does), and a kill.

Ray's `cluster_utils.AutoscalingCluster` is not used: it runs `ray stop --force`, which ends every Ray on the machine,
and reads a config file this Ray wheel does not ship. Here the head is a `cluster_utils.Cluster` node of this process
(on loopback, with the run's token authentication, like any local Ray of the project: cluster.py), its monitor runs
the autoscaler, and `shutdown` ends only this cluster's processes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import tempfile
import time

import psutil

from treepo_ray.runtime.cluster import LOOPBACK_ENV

os.environ.setdefault(LOOPBACK_ENV, "0")  # before Ray is imported: this cluster listens on 127.0.0.1 only
import ray  # noqa: E402
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID  # noqa: E402
from ray.core.generated import autoscaler_pb2  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaler_config(port: int, head: dict, workers: dict, idle_timeout_s: float) -> dict:
    """The autoscaler's cluster config: the fake provider, the head and the worker node types (name -> {resources,
    min_workers, max_workers}); a worker node idle for `idle_timeout_s` is removed."""
    types = {name: {"node_config": {}, **t} for name, t in workers.items()}
    types["ray.head.default"] = {"resources": head, "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": "treepo-fake", "max_workers": sum(t["max_workers"] for t in workers.values()),
        "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{port}", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": types, "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60, "auth": {}, "docker": {},
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


class LocalAutoscalingCluster:
    """Start with `head` resources ({"CPU": 2, ...}) and `workers` node types; `ray.init(address=c.address)` joins
    it. `shutdown` ends the head and every node the autoscaler started."""

    def __init__(self, head: dict, workers: dict, idle_timeout_s: float = 5.0):
        if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
            raise RuntimeError(f"Ray was imported before {LOOPBACK_ENV}=0 was set: this cluster would listen beyond "
                               "127.0.0.1 (runtime/cluster.py)")
        port = _free_port()
        fd, self._config = tempfile.mkstemp(suffix=".json", prefix="treepo-autoscaler-")
        with os.fdopen(fd, "w") as f:
            json.dump(autoscaler_config(port, head, workers, idle_timeout_s), f)
        # The monitor (the autoscaler) is a child of this process and reads these when it starts.
        os.environ["RAY_FAKE_CLUSTER"] = "1"
        os.environ["AUTOSCALER_UPDATE_INTERVAL_S"] = "1"
        resources = {k: v for k, v in head.items() if k not in ("CPU", "GPU")}
        self._cluster = Cluster(initialize_head=True, head_node_args={
            "gcs_server_port": port, "num_cpus": head.get("CPU", 0), "num_gpus": head.get("GPU", 0),
            "resources": resources,
            "autoscaling_config": self._config, "include_dashboard": False,
            # the provider knows the head by this id: under another, the autoscaler sees no head and adds no node
            "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID}})
        self.address = self._cluster.address
        self.session_dir = self._cluster.head_node.get_session_dir_path()

    def worker_nodes(self, resource: str) -> list[str]:
        """Ids of the live nodes (the head left out) that offer `resource`."""
        head = self._cluster.head_node.node_id
        return [n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["NodeID"] != head and n["Resources"].get(resource)]

    def shutdown(self) -> None:
        """Disconnect this driver, end the head and its monitor, then every process of the autoscaler's nodes (they
        share its session)."""
        ray.shutdown()
        self._cluster.shutdown()
        for proc in self._processes():
            proc.send_signal(signal.SIGKILL)
        os.unlink(self._config)

    def _processes(self, flag: str = "") -> list:
        """This cluster's processes (their command line names its session), and of those, only ones with `flag`."""
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            line = " ".join(proc.info["cmdline"] or ())
            if self.session_dir in line and flag in line:
                out.append(proc)
        return out

    def kill_node(self, node_id: str) -> int:
        """A preemption without notice: SIGKILL to the node's raylet and agents (its workers die with the raylet).
        Returns how many processes were killed."""
        procs = self._processes(f"--node_id={node_id}") + self._processes(f"--node-id={node_id}")
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        return len(procs)


def drain_node(node_id: str, deadline_s: float, why: str = "spot preemption notice") -> bool:
    """Announce to Ray that `node_id` goes away in `deadline_s` seconds (as `ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION` does): nothing new is placed there, and the run's pool sees it among the draining
    nodes. Whether Ray accepted it."""
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, _ = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), why,
                                 deadline_ms)
    return accepted
