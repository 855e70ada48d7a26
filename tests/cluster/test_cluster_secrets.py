"""Secrets and permissions of the cluster files (cluster/validate.py): the W&B key comes from a secret store and
reaches the head only, no key file is copied to the nodes, no credential is written in a manifest or a runtime env,
and nothing (the shared run storage above all) is made world-writable. Each broken case changes one thing in a
copy of a real file and expects the check to name it."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load_validator():
    if "cluster_validate" in sys.modules:  # loaded by test_cluster_files.py: one module, one ClusterConfigError
        return sys.modules["cluster_validate"]
    spec = importlib.util.spec_from_file_location("cluster_validate", ROOT / "cluster" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cluster_validate"] = module
    spec.loader.exec_module(module)
    return module


cv = _load_validator()
HEAD_START = "head_start_ray_commands.1"
WORKER_START = "worker_start_ray_commands.1"
HEAD_ENV = "spec.headGroupSpec.template.spec.containers.0.env"
LEARNER_ENV = "spec.workerGroupSpecs.0.template.spec.containers.0.env"


def _load(rel: str) -> dict:
    return yaml.safe_load((ROOT / rel).read_text())


def _node(doc, path: str):
    """The parent of the dotted `path` in `doc` (list indices as numbers) and the last key."""
    keys = path.split(".")
    for key in keys[:-1]:
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc, int(keys[-1]) if isinstance(doc, list) else keys[-1]


def _edit(path: str, old: str, new: str):
    """A mutation replacing `old` by `new` in the string at `path` (which must hold `old`)."""
    def apply(doc):
        parent, key = _node(doc, path)
        assert old in parent[key], (path, old)
        parent[key] = parent[key].replace(old, new)
    return apply


def _append(path: str, item):
    def apply(doc):
        parent, key = _node(doc, path)
        parent[key] = [*parent[key], item]
    return apply


def test_the_real_launcher_keeps_the_wandb_key_on_the_head_and_the_runs_private():
    launcher = _load("cluster/ray-cluster.yaml")
    cv.check_launcher(launcher)
    assert "WANDB_API_KEY=$(python $HOME/treepo-ray/cluster/wandb_key.py us-west-2)" in launcher[
        "head_start_ray_commands"][1]
    assert not any("WANDB" in c for c in launcher["worker_start_ray_commands"])
    assert launcher["file_mounts"] == {"~/treepo-ray": ".", "~/ray_auth": "~/.treepo-ray/auth"}
    assert "sudo chown 1000:100 /mnt/shared/runs && sudo chmod 2770 /mnt/shared/runs" in launcher[
        "initialization_commands"][0]


LAUNCHER_BREAKS = [
    ("W&B key read from a file copied to every node",
     _edit(HEAD_START, "$(python $HOME/treepo-ray/cluster/wandb_key.py us-west-2)",
           "$(cat $HOME/ray_auth/wandb_api_key 2>/dev/null)"),
     "head_start_ray_commands: WANDB_API_KEY is read from a key file on the node"),
    ("key read with a redirection", _edit(HEAD_START, "$(python $HOME/treepo-ray/cluster/wandb_key.py us-west-2)",
                                          '"$(< ~/keys/wandb)"'), "WANDB_API_KEY is read from a key file"),
    ("literal W&B key", _edit(HEAD_START, "$(python $HOME/treepo-ray/cluster/wandb_key.py us-west-2)", "0123abcd"),
     "WANDB_API_KEY is set to a literal value"),
    ("literal cloud key on a setup command", _append("setup_commands", "export AWS_SECRET_ACCESS_KEY=abc; true"),
     "setup_commands: AWS_SECRET_ACCESS_KEY is set to a literal value"),
    ("literal key in the containers' environment", _append("docker.run_options", "-e HF_TOKEN=hf_abc"),
     "docker.run_options: HF_TOKEN is set to a literal value"),
    ("key file among file_mounts", _edit("file_mounts.~/ray_auth", "~/.treepo-ray/auth", "~/.config/wandb"),
     "file_mounts copies a key file to every node (~/.config/wandb -> ~/ray_auth)"),
    ("W&B key on every worker", _edit(WORKER_START, "ray start",
                                      "WANDB_API_KEY=$(python $HOME/treepo-ray/cluster/wandb_key.py us-west-2) "
                                      "ray start"), "WANDB_API_KEY reaches every worker node"),
    ("secret read in another region", _edit(HEAD_START, "wandb_key.py us-west-2", "wandb_key.py eu-west-1"),
     "wandb_key.py reads the secret in region eu-west-1, not the cluster's region us-west-2"),
    ("world-writable run storage (sticky)", _edit("initialization_commands.0", "chmod 2770", "chmod 1777"),
     "/mnt/shared/runs is made world-writable (mode 1777)"),
    ("world-writable run storage (symbolic)", _edit("initialization_commands.0", "chmod 2770", "chmod -R o+w"),
     "/mnt/shared/runs is made world-writable (mode o+w)"),
    ("world-writable folder made by mkdir", _edit("initialization_commands.0", "sudo mkdir -p /mnt/shared/models",
                                                  "sudo mkdir -m 777 /mnt/shared/models"),
     "is made world-writable (mode 777)"),
]


@pytest.mark.parametrize("mode,writable", [
    ("1777", True), ("777", True), ("0666", True), ("o+w", True), ("a=rwx", True), ("u+rwx,o+rw", True),
    ("2770", False), ("0750", False), ("755", False), ("g+w", False), ("o-w", False), ("+w", False), ("a+rX", False),
])
def test_world_writable_modes(mode, writable):
    assert cv.world_writable(mode) is writable


def test_the_real_kuberay_files_take_the_wandb_key_from_a_secret():
    raycluster = _load("cluster/kuberay/raycluster.yaml")
    cv.check_raycluster(raycluster)
    cv.check_rayjob(_load("cluster/kuberay/rayjob.yaml"))
    head_env = {e["name"]: e for e in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "treepo-wandb", "key": "api-key",
                                                                      "optional": True}


KUBERAY_BREAKS = [
    ("W&B key written in the manifest", _append(HEAD_ENV, {"name": "WANDB_API_KEY", "value": "0123abcd"}),
     "containers[ray-head].env.WANDB_API_KEY: must come from a Secret (valueFrom.secretKeyRef)"),
    ("token from a config map", _append(LEARNER_ENV, {"name": "HF_TOKEN", "valueFrom": {
        "configMapKeyRef": {"name": "tokens", "key": "hf"}}}),
     "containers[ray-worker].env.HF_TOKEN: must come from a Secret"),
]


BREAKS = [("cluster/ray-cluster.yaml", cv.check_launcher, *b) for b in LAUNCHER_BREAKS] + \
    [("cluster/kuberay/raycluster.yaml", cv.check_raycluster, *b) for b in KUBERAY_BREAKS]


@pytest.mark.parametrize("path,check,mutate,expected", [(p, c, m, e) for p, c, _, m, e in BREAKS],
                         ids=[name for _, _, name, _, _ in BREAKS])
def test_a_secret_or_permission_break_fails(path, check, mutate, expected):
    broken = copy.deepcopy(_load(path))
    mutate(broken)
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        check(broken)


def test_kuberay_pod_command_making_storage_world_writable_fails():
    broken = copy.deepcopy(_load("cluster/kuberay/raycluster.yaml"))
    pod = broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    pod["initContainers"] = [{"name": "open-runs", "image": "busybox:1.37", "command": ["sh", "-c"],
                              "args": ["chmod 1777 /runs"]}]
    with pytest.raises(cv.ClusterConfigError, match=_re("containers[open-runs]: /runs is made world-writable")):
        cv.check_raycluster(broken)


def test_rayjob_runtime_env_with_a_credential_fails():
    broken = copy.deepcopy(_load("cluster/kuberay/rayjob.yaml"))
    broken["spec"]["runtimeEnvYAML"] += "  WANDB_API_KEY: 0123abcd\n"
    with pytest.raises(cv.ClusterConfigError, match=_re("env_vars ['WANDB_API_KEY']: a credential in the runtime "
                                                        "env is shown on the dashboard")):
        cv.check_rayjob(broken)


def test_wandb_key_reader_says_why_it_has_no_key_and_lets_the_head_start():
    # No secret to read here (no boto3, or no AWS credentials): nothing on stdout, so WANDB_API_KEY is empty and
    # the job logs offline; one line on stderr; exit 0, so that `ray start` still runs.
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_CONFIG_FILE": "/nonexistent"}
    env = {k: v for k, v in env.items() if not k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION", "AWS_PROFILE"))}
    result = subprocess.run([sys.executable, str(ROOT / "cluster/wandb_key.py"), "us-west-2"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == ""
    assert result.stderr.startswith("wandb_key.py: cannot read the secret treepo-ray/wandb-api-key in us-west-2 (")
    usage = subprocess.run([sys.executable, str(ROOT / "cluster/wandb_key.py")], capture_output=True, text=True)
    assert usage.returncode == 2 and "REGION" in usage.stderr


def _re(text: str) -> str:
    return re.escape(text)
