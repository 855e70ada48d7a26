"""A local run is closed: every port its Ray listens on is bound to the loopback interface, so nothing on another
address reaches it, and a client on this machine without Ray's token is refused (issue 49).

The Ray is started as every command starts it (runtime/cluster.py `init_ray`), in a process of its own with none of
the tests' Ray settings (conftest.py), so what is checked is the commands' own default."""

import ipaddress
import json
import os
import select
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# A local run's Ray as init_ray starts it (Ray is imported after it: it sets the loopback up before Ray reads it),
# one actor (a worker's own gRPC port), then what the test needs; the driver lives until its stdin closes.
DRIVER = """
import json, os, sys
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.cluster import init_ray

init_ray(load_config(DEFAULT_CONFIG, ["runtime.num_cpus=1"]))
import ray

@ray.remote(num_cpus=0)
class Worker:
    def pid(self):
        return os.getpid()

worker = Worker.remote()
info = {"worker_pid": ray.get(worker.pid.remote()), "gcs": ray.get_runtime_context().gcs_address,
        "dashboard": ray.init(ignore_reinit_error=True).dashboard_url, "auth_mode": os.environ.get("RAY_AUTH_MODE")}
print(json.dumps(info), flush=True)
sys.stdin.read()
"""


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def clean_env() -> dict:
    """This environment without the tests' Ray settings (conftest.py): the commands' own defaults."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                        "RAY_ADDRESS", "WANDB_SERVICE")}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """(info the driver printed, {pid: name} of the driver and every process under it)."""
    log = tmp_path_factory.mktemp("closed") / "driver.log"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, env=clean_env(), start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        line = proc.stdout.readline() if ready else ""
        if not line:
            pytest.fail(f"the local run did not start:\n{log.read_text()[-4000:]}")
        driver = psutil.Process(proc.pid)
        pids = {p.pid: p.name() for p in [driver, *driver.children(recursive=True)]}
        yield json.loads(line), pids
    finally:
        proc.stdin.close()  # the driver ends, and ray.shutdown with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its own left behind
        except ProcessLookupError:
            pass


def listening(pids: dict) -> list:
    return [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def other_addresses() -> list[str]:
    """This machine's addresses other than loopback (link-local IPv6 left out: it needs an interface scope)."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = ipaddress.ip_address(a.address.split("%")[0])
                if not ip.is_loopback and not ip.is_link_local:
                    found.append(str(ip))
    return found


def test_every_port_of_a_local_run_listens_on_loopback_only(local_run):
    info, pids = local_run
    sockets = listening(pids)
    ports = {c.laddr.port for c in sockets}
    by_pid = {pid: sorted(c.laddr.port for c in sockets if c.pid == pid) for pid in pids}
    # The scan saw the GCS and the actor's own worker process, not just a few of the run's processes.
    assert int(info["gcs"].rsplit(":", 1)[1]) in ports, (info, by_pid)
    assert by_pid.get(info["worker_pid"]), (info, by_pid)
    assert {"gcs_server", "raylet"} <= set(pids.values()), pids
    open_wide = [(pids[c.pid], c.laddr.ip, c.laddr.port) for c in sockets if not is_loopback(c.laddr.ip)]
    assert not open_wide, f"listening beyond loopback: {open_wide}"

    # From this machine's other addresses every one of those ports is closed (a port another process on this
    # machine listens on, such as another engineer's Ray, would answer for that process, so it is left out).
    others = {c.laddr.port for c in psutil.net_connections("tcp")
              if c.status == psutil.CONN_LISTEN and c.pid not in pids and not is_loopback(c.laddr.ip)}
    reached = []
    for host in other_addresses():
        for port in sorted(ports - others):
            try:
                socket.create_connection((host, port), timeout=2).close()
                reached.append((host, port))
            except OSError:
                pass  # refused (or filtered): not reachable
    assert not reached, f"reachable from a non-loopback address: {reached}"


def test_a_client_without_the_token_is_refused(local_run):
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    info, _ = local_run
    assert info["auth_mode"] == "token"  # Ray's own default for a new local Ray, no longer turned off
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()  # where ray.init keeps it

    # The GCS (gRPC): refused without the token, answered with it.
    with grpc.insecure_channel(info["gcs"]) as channel:
        get_cluster_id = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId
        with pytest.raises(grpc.RpcError) as refused:
            get_cluster_id(gcs_service_pb2.GetClusterIdRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        get_cluster_id(gcs_service_pb2.GetClusterIdRequest(), timeout=10,
                       metadata=(("authorization", f"Bearer {token}"),))

    # The dashboard (HTTP, where `ray job submit` goes): the same.
    url = f"http://{info['dashboard']}/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(url, timeout=10)
    assert denied.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}),
                                timeout=10) as answer:
        assert answer.status == 200


def test_a_local_ray_is_refused_if_ray_was_imported_before_init_ray():
    """Ray reads the loopback switch when imported: imported earlier, init_ray stops rather than open every port."""
    if not other_addresses():
        pytest.skip("no address but loopback here: a local Ray listens on loopback whatever the switch says")
    script = ("import ray\n"
              "from treepo_ray.job.config import DEFAULT_CONFIG, load_config\n"
              "from treepo_ray.runtime.cluster import init_ray\n"
              "init_ray(load_config(DEFAULT_CONFIG, []))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert done.returncode != 0 and "Ray was imported before init_ray" in done.stderr, done.stderr[-2000:]
