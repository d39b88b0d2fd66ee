"""Kubernetes manifests (issue 14 §5): deploy/kubernetes/quantd.yaml validates strictly against
the Kubernetes API schemas (kubernetes-validate, offline, no cluster) of the oldest and newest
versions we claim; the ServiceMonitor, a Prometheus Operator resource without a schema there, gets
a check of the fields it uses; and the pieces fit each other and the image: the Service selects
the pod and names its ports, the ServiceMonitor scrapes the metrics port, the probes ask the gRPC
health service on the API port, the state claim is mounted at the config's state dir, and the
ConfigMap's serve.json is accepted by `quantd serve`.
"""

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "quantd.yaml"
VERSIONS = ["1.29.0", "1.37.0"]  # grpc probes are GA since 1.27


@pytest.fixture(scope="module")
def docs():
    loaded = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {d["kind"]: d for d in loaded}


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
    # quantd serve accepts the ConfigMap's config (the harness's flags override addresses).
    # The token Secret is mounted where the config's token_file points.
    token_mount = mounts["token"]
    assert config["token_file"].startswith(token_mount + "/")
    assert volumes["token"]["secret"]["secretName"] == "quantd-token"
    token = tmp_path / "token"
    token.write_text("test-token-0123456789abcdef\n")
    token.chmod(0o600)
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({**config, "token_file": str(token)}))
    with Daemon(qd.binary, tmp_path / "state", "--config", path) as daemon:
        daemon.stop()
