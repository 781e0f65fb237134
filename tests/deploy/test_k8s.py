"""The Kubernetes manifests (``deploy/k8s``) against the Kubernetes API schemas, and against
each other, the gateway config and the gateway's metrics.

No cluster is reachable here, so what is checked is what can be checked offline:

- every object of the base, the ConfigMaps its generators make, the example Secret and the
  GPU overlay's objects (its JSON patches applied to the base's, as kustomize applies them)
  validate against the schemas of Kubernetes 1.30 and 1.37 in strict mode (no unknown field)
  with ``kubernetes-validate``;
- the custom resources (``ValkeyCluster``, ``ServiceMonitor``) are outside those schemas:
  their API groups and the fields they use are checked here by hand, against the operators'
  documentation, not against the operators' own schemas;
- Services select the pods of their workloads by the ports those pods name; the HPAs scale
  workloads that exist, on external metrics that the Prometheus adapter's rules define, from
  series the gateway exports; the configs load as the gateway loads them; pod 0 of each pool
  is the server the config names.

Not checked: kustomize's own rendering (no kustomize binary here), admission webhooks,
scheduling, the operators' behaviour, anything at run time.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from backends.config import VllmBackendConfig
from backends.scraped_metrics import parse_upstream_metrics
from semcache.policy import load_policy
from server.config import load_config
from tests.server.test_grafana_dashboards import exported, metric_names

__all__ = ["exported"]  # the fixture: every series the gateway's /metrics exposes

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
VERSIONS = ("1.30.0", "1.37.0")
CUSTOM_KINDS = {
    ("valkey.io/v1alpha1", "ValkeyCluster"): {
        "shards", "replicas", "workloadType", "persistence", "config", "resources",
    },
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"selector", "endpoints"},
}  # fmt: skip
"""The custom kinds the manifests use, with the spec fields they may set."""

Obj = dict[str, Any]


def documents(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(folder: Path) -> Obj:
    data: Obj = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return data


def generated_config_maps(folder: Path, spec: Obj) -> Iterator[Obj]:
    options = spec.get("generatorOptions", {})
    for generator in spec.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in generator.get("files", [])}
        yield {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"], "labels": options.get("labels", {})},
            "data": data,
        }


def render(folder: Path) -> list[Obj]:
    """The objects of a kustomization: its resources (folders recursively), its generated
    ConfigMaps, its JSON patches applied to their targets, its namespace set."""
    spec = kustomization(folder)
    objects: list[Obj] = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        objects += render(path) if path.is_dir() else documents(path)
    for generated in generated_config_maps(folder, spec):
        if any(g.get("behavior") == "merge" for g in spec.get("configMapGenerator", [])):
            (base,) = [o for o in objects if o["metadata"]["name"] == generated["metadata"]["name"]]
            base["data"].update(generated["data"])
        else:
            objects.append(generated)
    for patch in spec.get("patches", []):
        ops = jsonpatch.JsonPatch(yaml.safe_load((folder / patch["path"]).read_text()))
        target = patch["target"]
        hits = [
            i
            for i, o in enumerate(objects)
            if o["kind"] == target["kind"]
            and re.fullmatch(target.get("name", ".*"), o["metadata"]["name"])
        ]
        assert hits, f"{patch['path']}: no {target} in the base"
        for i in hits:
            objects[i] = ops.apply(objects[i])
    if namespace := spec.get("namespace"):
        for o in objects:
            if o["kind"] != "Namespace":
                o["metadata"]["namespace"] = namespace
    return objects


BASE = render(K8S)
GPU = render(K8S / "overlays" / "gpu")


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[Obj]) -> dict[str, Obj]:
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}


def ids(objects: list[Obj]) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in objects]


BUILTIN = [o for o in BASE if (o["apiVersion"], o["kind"]) not in CUSTOM_KINDS]
SECRET = documents(K8S / "secret.example.yaml")
OVERLAID = [o for o in GPU if o["kind"] in ("StatefulSet", "Deployment", "ConfigMap")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("obj", [*BUILTIN, *SECRET], ids=ids([*BUILTIN, *SECRET]))
def test_every_object_validates_against_the_kubernetes_schema(obj: Obj, version: str) -> None:
    kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)


@pytest.mark.parametrize("obj", OVERLAID, ids=ids(OVERLAID))
def test_the_gpu_overlay_s_objects_validate_too(obj: Obj) -> None:
    kubernetes_validate.validate(copy.deepcopy(obj), VERSIONS[-1], strict=True)


def test_the_deployment_has_what_the_issue_names() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in BASE}
    assert {
        ("Deployment", "semcache-gateway"),
        ("PodDisruptionBudget", "semcache-gateway"),
        ("HorizontalPodAutoscaler", "semcache-gateway"),
        ("StatefulSet", "semcache-prefill"),
        ("HorizontalPodAutoscaler", "semcache-prefill"),
        ("StatefulSet", "semcache-decode"),
        ("HorizontalPodAutoscaler", "semcache-decode"),
        ("ConfigMap", "semcache-config"),
        ("ValkeyCluster", "semcache-cache"),
        ("ServiceMonitor", "semcache-gateway"),
    } <= kinds
    dashboards = [o for o in BASE if o["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert sorted(f for o in dashboards for f in o["data"]) == sorted(
        p.name for p in (DEPLOY / "grafana").glob("*.json")
    )


def test_custom_resources_use_the_operators_fields() -> None:
    custom = [o for o in BASE if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS]
    assert {o["kind"] for o in custom} == {"ValkeyCluster", "ServiceMonitor"}
    for o in custom:
        assert set(o["spec"]) <= CUSTOM_KINDS[(o["apiVersion"], o["kind"])], o["metadata"]
    (valkey,) = by_kind(BASE, "ValkeyCluster").values()
    assert valkey["spec"]["shards"] == 3 and valkey["spec"]["replicas"] >= 1
    assert all(isinstance(v, str) for v in valkey["spec"]["config"].values())


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def test_services_select_their_pods_by_named_ports() -> None:
    pods = {name: pod_labels(w) for name, w in workloads(BASE).items()}
    for name, service in by_kind(BASE, "Service").items():
        (workload,) = [
            w for w, labels in pods.items() if service["spec"]["selector"].items() <= labels.items()
        ]
        container = workloads(BASE)[workload]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, name
    for name, monitor in by_kind(BASE, "ServiceMonitor").items():
        selected = [
            s for s in by_kind(BASE, "Service").values() if selects(monitor["spec"]["selector"], s)
        ]
        assert selected, f"ServiceMonitor {name} selects no Service"
        for service in selected:
            ports = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def selects(selector: Obj, obj: Obj) -> bool:
    labels = obj["metadata"].get("labels", {})
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def adapter_rules() -> dict[str, Obj]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {rule["name"]["as"]: rule for rule in values["rules"]["external"]}


def test_the_hpas_scale_workloads_on_metrics_the_adapter_serves(exported: set[str]) -> None:
    rules = adapter_rules()
    for name, hpa in by_kind(BASE, "HorizontalPodAutoscaler").items():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["name"] in by_kind(BASE, target["kind"]), name
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "External":
                assert metric["external"]["metric"]["name"] in rules, name
    for name, rule in rules.items():
        series = metric_names(rule["seriesQuery"]) | metric_names(rule["metricsQuery"])
        assert series and series <= exported | copied(series), f"{name}: {series - exported}"
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]  # the HPA's namespace and selector


UPSTREAM = "semcache_upstream_vllm_"


def copied(series: set[str]) -> set[str]:
    """Those of ``series`` that copy a vLLM server's gauge the gateway keeps from its scrapes
    (``semcache_upstream_vllm_x``: ``vllm:x``), present once a server was scraped."""
    out = set()
    for name in series:
        if name.startswith(UPSTREAM):
            original = "vllm:" + name.removeprefix(UPSTREAM)
            page = f'# TYPE {original} gauge\n{original}{{engine="0"}} 1.0\n'
            if [s.name for s in parse_upstream_metrics(page)] == [original]:
                out.add(name)
    return out


def test_pod_0_of_each_pool_is_the_server_the_config_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMCACHE_API_TOKEN", "test")
    for objects, folder in ((BASE, K8S / "config"), (GPU, K8S / "overlays" / "gpu")):
        config = load_config(folder / "config.toml")
        (vllm,) = [b for b in config.backends if isinstance(b, VllmBackendConfig)]
        urls = {s.role: s.url for s in vllm.servers}
        for role in ("prefill", "decode"):
            sets = by_kind(objects, "StatefulSet")
            assert sets[f"semcache-{role}"]["spec"]["serviceName"] == f"semcache-{role}"
            assert urls[role] == f"http://semcache-{role}-0.semcache-{role}:8000"
        for hpa in ("semcache-prefill", "semcache-decode"):
            for metric in by_kind(objects, "HorizontalPodAutoscaler")[hpa]["spec"]["metrics"]:
                selector = metric["external"]["metric"]["selector"]
                assert selector["matchLabels"]["backend"] == vllm.name
    load_policy(K8S / "config" / "policy.toml")


def test_every_pod_runs_as_the_image_s_user_with_a_read_only_root() -> None:
    for name, workload in workloads(GPU).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001, name
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/etc/semcache", "/var/lib/semcache", "/tmp"} <= mounts, name
            secrets = {
                e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})
            }
            assert {"SEMCACHE_API_TOKEN", "SEMCACHE_ADMIN_TOKEN"} <= secrets, name
