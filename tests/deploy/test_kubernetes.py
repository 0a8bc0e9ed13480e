"""deploy/kubernetes (issue 13, acceptance 5): every manifest validates offline against the
Kubernetes schemas (kubernetes-validate), and every container's command, flags, ports,
probes, Secret references and volumes agree with the services' own CLIs."""

from __future__ import annotations

import argparse
import copy
import importlib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.default_model import CACHE_ENV
from services.security import API_KEY_ENV, TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.30"  # native gRPC probes are GA since 1.27


def load_all() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return docs


DOCS = load_all()


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every workload."""
    return [
        (d, c)
        for d in DOCS
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def parse(container: dict[str, Any]) -> tuple[str, argparse.Namespace]:
    """The container's module and its args parsed by that module's own argparse parser."""
    command = container["command"]
    assert command[:2] == ["python", "-m"] and len(command) == 3, command
    module = command[2]
    return module, importlib.import_module(f"{module}.__main__").parse_args(container["args"])


def port_numbers(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_offline(doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_validation_catches_mistakes() -> None:
    broken = copy.deepcopy(find("StatefulSet", "tessera-engine"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50061"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(find("Deployment", "tessera-gateway"))
    unknown["spec"]["replicaz"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)


def test_the_topology_is_present() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    assert {("Deployment", "tessera-gateway"), ("Service", "tessera-gateway"),
            ("HorizontalPodAutoscaler", "tessera-gateway"), ("StatefulSet", "tessera-engine"),
            ("Service", "tessera-engine"), ("Secret", "tessera")} <= kinds  # fmt: skip
    hpa = find("HorizontalPodAutoscaler", "tessera-gateway")["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", "tessera-gateway")


def test_engine_pod_runs_a_scheduler_and_its_worker() -> None:
    engine = find("StatefulSet", "tessera-engine")
    by_name = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
    assert set(by_name) == {"worker", "scheduler"}
    w_module, worker = parse(by_name["worker"])
    s_module, scheduler = parse(by_name["scheduler"])
    assert (w_module, s_module) == ("worker_service", "scheduler_service")
    assert scheduler.worker == [f"127.0.0.1:{worker.port}"]  # same pod: shared loopback
    assert port_numbers(by_name["worker"]) == {"worker": worker.port}
    assert port_numbers(by_name["scheduler"]) == {"grpc": scheduler.port}
    assert scheduler.host == "0.0.0.0" and worker.host == "0.0.0.0"  # kubelet probes the pod IP
    for container, port in (
        (by_name["worker"], worker.port),
        (by_name["scheduler"], scheduler.port),
    ):
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == port, (container["name"], probe)


def test_headless_service_discovers_the_engines() -> None:
    service = find("Service", "tessera-engine")["spec"]
    engine = find("StatefulSet", "tessera-engine")
    assert service["clusterIP"] == "None"
    assert engine["spec"]["serviceName"] == "tessera-engine"
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    assert engine["spec"]["selector"]["matchLabels"].items() <= labels.items()
    scheduler = next(c for c in engine["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "scheduler")  # fmt: skip
    (port,) = service["ports"]
    assert port_numbers(scheduler)[port["targetPort"]] == port["port"] == parse(scheduler)[1].port
    _, gateway = parse(
        find("Deployment", "tessera-gateway")["spec"]["template"]["spec"]["containers"][0]
    )
    assert gateway.scheduler == [f"tessera-engine:{port['port']}"]  # one name, re-resolved


def test_gateway_service_ports_and_probes_match_its_flags() -> None:
    deployment = find("Deployment", "tessera-gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    module, gateway = parse(container)
    assert module == "gateway" and gateway.host == "0.0.0.0"
    ports = port_numbers(container)
    assert ports == {"http": gateway.port, "grpc": gateway.grpc_port}
    service = find("Service", "tessera-gateway")["spec"]
    assert (
        service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert {p["targetPort"] for p in service["ports"]} == set(ports)
    assert container["livenessProbe"]["grpc"]["port"] == gateway.grpc_port
    ready = container["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and ports[ready["port"]] == gateway.port


def test_secrets_resources_and_volumes() -> None:
    secret = find("Secret", "tessera")["stringData"]
    for workload, container in containers():
        env = {e["name"]: e for e in container.get("env", [])}
        token = env[TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        assert token["name"] == "tessera" and token["key"] in secret, container["name"]
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), container["name"]
        if CACHE_ENV in env:  # the model cache is a mounted volume
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volume = mounts[env[CACHE_ENV]["value"]]
            spec = workload["spec"]
            names = [v["name"] for v in spec["template"]["spec"].get("volumes", [])]
            names += [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])]
            assert volume in names, container["name"]
    (gateway,) = find("Deployment", "tessera-gateway")["spec"]["template"]["spec"]["containers"]
    api_key = {e["name"]: e for e in gateway["env"]}[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert api_key["key"] in secret
    worker = find("StatefulSet", "tessera-engine")["spec"]["template"]["spec"]["containers"][0]
    assert CACHE_ENV in {e["name"] for e in worker["env"]}
