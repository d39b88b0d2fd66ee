"""Kubernetes manifests (issue 14 §5, issue 22 item 4): deploy/kubernetes/quantd.yaml and
workers.yaml validate strictly against the Kubernetes API schemas (kubernetes-validate, offline, no
cluster) of the oldest and newest versions we claim; the ServiceMonitor, a Prometheus Operator
resource without a schema there, gets a check of the fields it uses; and the pieces fit each other
and the image: the Service selects the pod and names its ports, the ServiceMonitor scrapes the
metrics port, the probes ask the gRPC health service on the API port, the state claim is mounted at
the config's state dir, the init container copies both Secrets' tokens where the config reads
them, and the ConfigMap's serve.json and access.json are accepted by `quantd serve`. The workers'
Indexed Job uses the coordinator's image, Service, models claim, user and worker-token Secret,
only flags `quantd worker --help` lists, and its command line registers with a daemon run from the
ConfigMap's config and exits when idle.
"""

import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "quantd.yaml"
WORKERS = REPO / "deploy" / "kubernetes" / "workers.yaml"
VERSIONS = ["1.29.0", "1.37.0"]  # grpc probes are GA since 1.27


@pytest.fixture(scope="module")
def docs():
    loaded = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in loaded}


@pytest.fixture(scope="module")
def workers():
    loaded = [d for d in yaml.safe_load_all(WORKERS.read_text()) if d]
    assert [d["kind"] for d in loaded] == ["Job"]
    return loaded[0]


def test_core_resources_validate_strictly(docs):
    assert sorted(docs) == ["ConfigMap", "Service", "ServiceMonitor", "StatefulSet"]
    for kind in ("ConfigMap", "StatefulSet", "Service"):
        for version in VERSIONS:
            kubernetes_validate.validate(docs[kind], version, strict=True)


def test_validation_rejects_a_typo(docs):
    """The check above can fail: an unknown field is an error under strict validation."""
    broken = json.loads(json.dumps(docs["Service"]))
    broken["spec"]["ports"][0]["targetPorts"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_service_monitor_fields(docs):
    monitor = docs["ServiceMonitor"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitor, VERSIONS[-1], strict=True)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}, monitor
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", monitor["metadata"]["name"])
    spec = monitor["spec"]
    assert set(spec) == {"selector", "endpoints"}, spec
    assert set(spec["selector"]) == {"matchLabels"}, spec["selector"]
    service = docs["Service"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}, endpoint
        assert endpoint["port"] in port_names, endpoint
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"]), endpoint


def test_pieces_fit_together(docs, qd, tmp_path):
    config_map, sts, service = docs["ConfigMap"], docs["StatefulSet"], docs["Service"]
    config = json.loads(config_map["data"]["serve.json"])
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # The container's ports are the config's.
    assert ports["grpc"] == int(config["listen"][0].rsplit(":", 1)[1])
    assert ports["metrics"] == int(config["metrics_listen"].rsplit(":", 1)[1])
    # The Service selects the pod and forwards to named container ports.
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    # Probes: grpc.health.v1 on the API port for the API service.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": ports["grpc"],
                                            "service": "quantd.v1.QuantService"}, probe
    # The image's entrypoint reads /etc/quantd/serve.json: the ConfigMap is mounted there and
    # nothing overrides the entrypoint.
    assert "command" not in container and "args" not in container
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["config"] == "/etc/quantd"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    # The state claim holds the state dir.
    claims = [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    assert claims == ["state"] and mounts["state"] == config["state_dir"]
    # The image's user (deploy/docker/Dockerfile), never root, no privilege escalation.
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"useradd --system --uid (\d+)", dockerfile).group(1))
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == uid
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Tokens: the init container copies the projected Secrets into the memory-backed dir the
    # daemon mounts, where serve.json's token_file and access.json's worker token_file point.
    init = pod["spec"]["initContainers"][0]
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert init["image"] == container["image"]
    assert init["command"][:5] == ["install", "-m", "0600", "-t", init_mounts["tokens"]]
    assert mounts["tokens"] == init_mounts["tokens"]
    assert volumes["tokens"]["emptyDir"]["medium"] == "Memory"
    secrets = {item["path"]: source["secret"]["name"]
               for source in volumes["secrets"]["projected"]["sources"]
               for item in source["secret"]["items"]}
    assert secrets == {"token": "quantd-token", "worker-token": "quantd-worker-token"}
    assert init["command"][5:] == [f"{init_mounts['secrets']}/{p}" for p in secrets]
    access = json.loads(config_map["data"]["access.json"])
    assert access == {"callers": [{"token_file": f"{mounts['tokens']}/worker-token",
                                   "role": "worker"}]}
    assert config["token_file"] == f"{mounts['tokens']}/token"
    assert config["access_config"] == f"{mounts['config']}/access.json"
    # quantd serve accepts the ConfigMap's config (the harness's flags override addresses).
    with config_daemon(qd, config_map, tmp_path) as daemon:
        daemon.stop()


def private_token(path, text):
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def config_daemon(qd, config_map, tmp_path, *extra):
    """A daemon run from the ConfigMap's serve.json and access.json, its files under tmp_path."""
    config = json.loads(config_map["data"]["serve.json"])
    access = json.loads(config_map["data"]["access.json"])
    worker_token = private_token(tmp_path / "worker-token", "worker-token-0123456789abcdef")
    access["callers"][0]["token_file"] = str(worker_token)
    (tmp_path / "access.json").write_text(json.dumps(access))
    token = private_token(tmp_path / "token", "test-token-0123456789abcdef")
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({**config, "token_file": str(token),
                                "access_config": str(tmp_path / "access.json")}))
    return Daemon(qd.binary, tmp_path / "state", "--config", path, *extra)


def test_workers_validate_strictly(workers):
    for version in VERSIONS:
        kubernetes_validate.validate(workers, version, strict=True)


def worker_flags(qd):
    """The long options `quantd worker --help` lists."""
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", qd.run_ok("worker", "--help").stdout))


def test_workers_fit_the_coordinator(docs, workers, qd):
    sts, service, config_map = docs["StatefulSet"], docs["Service"], docs["ConfigMap"]
    spec = workers["spec"]
    assert workers["kind"] == "Job" and workers["apiVersion"] == "batch/v1"
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 1
    pod = spec["template"]
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    [container] = pod["spec"]["containers"]
    coordinator = sts["spec"]["template"]["spec"]["containers"][0]
    # The coordinator's image, run as `quantd worker` with one GPU.
    assert container["image"] == coordinator["image"]
    assert container["command"] == ["quantd", "worker"]
    args = dict(a[2:].split("=", 1) for a in container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert args["devices"] == "cuda:0"
    # Every flag is one `quantd worker` has; the worker has no port, so there is no probe.
    assert {f"--{k}" for k in args} <= worker_flags(qd), set(args)
    assert not {"--listen", "--metrics-listen"} & worker_flags(qd)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(container)
    # The coordinator: the Service's name and gRPC port.
    grpc_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"]
    assert args["coordinator"] == f"{service['metadata']['name']}:{grpc_port}"
    assert int(args["exit-when-idle"]) > 0
    # One name per pod: the pod's own, from the downward API.
    assert args["name"] == "$(POD_NAME)"
    assert container["env"] == [{"name": "POD_NAME", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.name"}}}]
    # The models claim, mounted where the coordinator mounts it.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    sts_volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    sts_mounts = {m["name"]: m["mountPath"] for m in coordinator["volumeMounts"]}
    assert volumes["models"] == sts_volumes["models"]
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "quantd-models"
    assert mounts["models"]["mountPath"] == sts_mounts["models"] == "/srv/models"
    # The worker token: the Secret whose key the coordinator's access config gives the worker
    # role, mounted as a file (subPath: a regular file, not the Secret volume's symlink).
    access = json.loads(config_map["data"]["access.json"])
    worker_entries = [c for c in access["callers"] if c["role"] == "worker"]
    secrets = {item["path"]: (source["secret"]["name"], item["key"])
               for source in sts_volumes["secrets"]["projected"]["sources"]
               for item in source["secret"]["items"]}
    [entry] = worker_entries
    secret_name, key = secrets[Path(entry["token_file"]).name]
    token_volume = volumes["worker-token"]["secret"]
    assert token_volume["secretName"] == secret_name == "quantd-worker-token"
    assert token_volume["defaultMode"] == 0o400
    assert mounts["worker-token"] == {"name": "worker-token", "readOnly": True, "subPath": key,
                                      "mountPath": args["token-file"]}
    # The coordinator's user and hardening.
    assert pod["spec"]["securityContext"] == sts["spec"]["template"]["spec"]["securityContext"]
    assert container["securityContext"] == coordinator["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert mounts["tmp"]["mountPath"] == "/tmp" and volumes["tmp"] == {"name": "tmp",
                                                                       "emptyDir": {}}


def test_workers_command_line_registers_and_exits_when_idle(docs, workers, qd, tmp_path):
    """The Job's worker arguments (the address, token path, device and the idle time swapped for
    this machine's) register with a daemon run from the ConfigMap's config, with the token its
    access.json gives the worker role, and the worker exits 0 once idle."""
    container = workers["spec"]["template"]["spec"]["containers"][0]
    with config_daemon(qd, docs["ConfigMap"], tmp_path, "--listen", "127.0.0.1:0") as daemon:
        local = {"coordinator": daemon.tcp_address,
                 "token-file": str(tmp_path / "worker-token"),
                 "devices": "cpu", "exit-when-idle": "1"}
        args = []
        for arg in container["args"]:
            flag, value = arg[2:].split("=", 1)
            value = local.get(flag, value.replace("$(POD_NAME)", "quantd-workers-0-x7k2p"))
            args.append(f"--{flag}={value}")
        proc = subprocess.run([qd.binary, *container["command"][1:], *args, "--cpu-threads=1"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "registered as quantd-workers-0-x7k2p with 1 device(s)" in proc.stderr
        assert "idle for 1 s; exiting" in proc.stderr
        daemon.stop()
