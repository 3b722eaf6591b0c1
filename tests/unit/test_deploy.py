"""The deployment artefacts: the kustomize base renders and validates, the CRDs hold the
examples, the Deployment's arguments parse, the metrics port's RBAC and the ServiceMonitor agree
with the server, the Envoy Gateway wiring agrees with the EPP and the other files, the
Dockerfile runs as non-root without build tools."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed
import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.extproc import stream, wire
from endpoint_picker.requests import HEALTH_PATH, INFERENCE_PATHS, MODELS_PATH
from endpoint_picker.settings import MetricsAuth, Settings
from endpoint_picker.status.server import OPEN_PATHS, OPEN_PREFIX, MetricsServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests target (gRPC probes are GA)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize(path: Path) -> list[dict[str, Any]]:
    """Every object `kubectl kustomize PATH` renders (the test skips without kubectl)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered_all() -> list[dict[str, Any]]:
    """Every object `kubectl kustomize deploy/kubernetes` renders."""
    return kustomize(DEPLOY / "kubernetes")


@pytest.fixture(scope="module")
def rendered(rendered_all: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rendered objects by kind (of the kinds with several objects, the last)."""
    return {d["kind"]: d for d in rendered_all}


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def crd_schema(group: str, plural: str, version: str) -> dict[str, Any]:
    for path in (DEPLOY / "crds").glob("*.yaml"):
        for doc in load_all(path):
            if doc["kind"] != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            if spec["group"] == group and spec["names"]["plural"] == plural:
                for v in spec["versions"]:
                    if v["name"] == version:
                        return dict(v["schema"]["openAPIV3Schema"])
    raise AssertionError(f"no CRD for {plural}.{group}/{version}")


def test_kustomize_base_renders_the_expected_objects(rendered_all: list[dict[str, Any]]) -> None:
    """kubectl kustomize deploy/kubernetes gives exactly the EPP's objects: its five, and the
    metrics port's two ClusterRoles and one ClusterRoleBinding."""
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered_all) == [
        ("ClusterRole", "endpoint-picker-metrics-auth"),
        ("ClusterRole", "endpoint-picker-metrics-reader"),
        ("ClusterRoleBinding", "endpoint-picker-metrics-auth"),
        ("Deployment", "endpoint-picker"),
        ("Role", "endpoint-picker"),
        ("RoleBinding", "endpoint-picker"),
        ("Service", "endpoint-picker"),
        ("ServiceAccount", "endpoint-picker"),
    ]


def test_rendered_objects_and_crds_validate_against_kubernetes_schemas(
    rendered_all: list[dict[str, Any]],
) -> None:
    """Every rendered object and every CRD passes Kubernetes' own schemas (strict)."""
    crds = [d for p in sorted((DEPLOY / "crds").glob("*_*.yaml")) for d in load_all(p)]
    assert len(crds) == 4
    for obj in [*rendered_all, *crds]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_deployment_is_hardened_and_probed_on_9003(rendered: dict[str, dict[str, Any]]) -> None:
    """Non-root, read-only root filesystem, no capabilities, gRPC probes on 9003, requests set,
    and a grace period longer than the drain."""
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    args = container["args"]
    drain = args[args.index("--drain-timeout") + 1]
    assert pod["terminationGracePeriodSeconds"] > int(drain.removesuffix("s"))
    ports = {p["port"] for p in rendered["Service"]["spec"]["ports"]}
    assert ports == {9002, 9003, 9090}


def test_deployment_args_parse_into_kubernetes_settings(
    rendered: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Deployment's arguments are valid `epp` flags selecting the Kubernetes source."""
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    monkeypatch.setenv("NAMESPACE", "serving")  # what the downward API sets
    settings = settings_from_args(build_parser().parse_args(container["args"]))
    assert settings.pool.pool_file is None
    assert settings.pool.pool_name == "vllm-llama3-8b"
    assert settings.pool.kubernetes.namespace == "serving"
    assert settings.server.metrics_endpoint.auth is MetricsAuth.KUBERNETES
    # one process on h2, which needs no worker turnover (grpcio leaked on reset streams)
    assert settings.server.worker_max_requests == 0
    assert settings.server.ext_proc_server == "h2"
    assert not settings.server.supervised


def test_metrics_auth_rbac_lets_the_epp_review_tokens_and_nothing_more(
    rendered_all: list[dict[str, Any]],
) -> None:
    """The EPP's ServiceAccount may create tokenreviews and subjectaccessreviews (cluster-wide
    kinds: a ClusterRole and ClusterRoleBinding), nothing else; the binding follows the
    ServiceAccount into the overlay's namespace."""
    role = named(rendered_all, "ClusterRole", "endpoint-picker-metrics-auth")
    assert role["rules"] == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["subjectaccessreviews"],
            "verbs": ["create"],
        },
    ]
    binding = named(rendered_all, "ClusterRoleBinding", "endpoint-picker-metrics-auth")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "endpoint-picker-metrics-auth",
    }
    account = named(rendered_all, "ServiceAccount", "endpoint-picker")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "default"}
    ]
    overlay = kustomize_overlay("namespace: serving\n")
    (subject,) = named(overlay, "ClusterRoleBinding", "endpoint-picker-metrics-auth")["subjects"]
    assert subject["namespace"] == "serving"


def test_metrics_reader_role_grants_get_on_every_guarded_path_of_the_port() -> None:
    """endpoint-picker-metrics-reader allows `get` on exactly the metrics port's routes that
    need a token (the server's routes but the open probes and page files): what Prometheus and
    the status page read, so a new route cannot be forgotten here."""
    (role,) = [
        d
        for d in load_all(DEPLOY / "kubernetes" / "metrics-auth.yaml")
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "endpoint-picker-metrics-reader"
    ]
    (rule,) = role["rules"]
    assert rule["verbs"] == ["get"]
    server = MetricsServer(lambda: b"", None)  # type: ignore[arg-type]  # routes only
    routes = {r.resource.canonical for r in server.application().router.routes() if r.resource}
    guarded = {r for r in routes if r not in OPEN_PATHS and not r.startswith(OPEN_PREFIX)}
    assert guarded == {"/metrics", "/api/status"}
    assert set(rule["nonResourceURLs"]) == guarded


def test_rbac_is_namespaced_and_read_only(rendered: dict[str, dict[str, Any]]) -> None:
    """The Role only reads pods and the inference kinds; it is bound to the EPP."""
    rules = rendered["Role"]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "list", "watch"}
    assert {res for r in rules for res in r["resources"]} == {
        "pods",
        "inferencepools",
        "inferencemodels",
        "inferenceobjectives",
    }
    binding = rendered["RoleBinding"]
    assert binding["subjects"][0]["name"] == rendered["ServiceAccount"]["metadata"]["name"]
    assert (
        rendered["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
        == (rendered["ServiceAccount"]["metadata"]["name"])
    )


def test_ha_component_adds_two_replicas_leader_election_and_lease_rbac(tmp_path: Path) -> None:
    """deploy/kubernetes/ha in an overlay: two replicas, the flag (which parses), and lease
    verbs in a Role of their own; every object still validates."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    base = os.path.relpath(DEPLOY / "kubernetes", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}]\ncomponents: [{base}/ha]\n"
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    settings = settings_from_args(build_parser().parse_args(container["args"]))
    assert settings.pool.kubernetes.leader_election
    lease_rules = [
        r for o in objects if o["kind"] == "Role" for r in o["rules"] if "leases" in r["resources"]
    ]
    assert lease_rules == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]


def kustomize_overlay(extra: str, components: str = "") -> list[dict[str, Any]]:
    """Render an overlay of deploy/kubernetes (``extra``: more kustomization lines)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    with tempfile.TemporaryDirectory() as folder:
        base = os.path.relpath(DEPLOY / "kubernetes", folder)
        (Path(folder) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{base}]\n{extra}"
        )
        out = subprocess.run(
            [kubectl, "kustomize", folder], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_service_monitor_example_scrapes_the_service_with_a_reader_token(
    rendered_all: list[dict[str, Any]],
) -> None:
    """deploy/examples/kubernetes/servicemonitor.yaml: its ServiceAccount, token Secret and
    ClusterRoleBinding pass Kubernetes' schemas; the binding gives that ServiceAccount the
    base's metrics-reader role; the ServiceMonitor selects the base's Service by its labels,
    scrapes a port the Service names at /metrics, and sends the Secret's token as a bearer
    token; the PodMonitor sends the same token."""
    docs = load_all(DEPLOY / "examples" / "kubernetes" / "servicemonitor.yaml")
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    account = named(docs, "ServiceAccount", "endpoint-picker-metrics-scraper")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["type"] == "kubernetes.io/service-account-token"
    annotation = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert annotation == account["metadata"]["name"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    reader = named(rendered_all, "ClusterRole", "endpoint-picker-metrics-reader")
    assert binding["roleRef"]["name"] == reader["metadata"]["name"]
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [
        ("ServiceAccount", account["metadata"]["name"])
    ]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    service = named(rendered_all, "Service", "endpoint-picker")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    bearer = {
        "type": "Bearer",
        "credentials": {"name": secret["metadata"]["name"], "key": "token"},
    }
    assert endpoint["authorization"] == bearer
    (pod_monitor,) = load_all(DEPLOY / "examples" / "kubernetes" / "podmonitor.yaml")
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert pod_endpoint["authorization"] == bearer


def _example_objects() -> list[dict[str, Any]]:
    docs = load_all(DEPLOY / "examples" / "pool.yaml")
    for path in sorted((DEPLOY / "examples").glob("kubernetes/*.yaml")):
        docs += load_all(path)
    return [
        d for d in docs if d["kind"] in ("InferencePool", "InferenceModel", "InferenceObjective")
    ]


def _schema_for(obj: dict[str, Any]) -> dict[str, Any]:
    group, version = obj["apiVersion"].split("/")
    return crd_schema(group, obj["kind"].lower() + "s", version)


def test_example_pools_and_models_validate_against_the_repo_crds() -> None:
    """Every example InferencePool, InferenceModel and InferenceObjective satisfies the repo's
    CRD schema."""
    objects = _example_objects()
    assert {o["kind"] for o in objects} == {"InferencePool", "InferenceModel", "InferenceObjective"}
    for obj in objects:
        jsonschema.validate(obj, _schema_for(obj))


def test_example_workloads_validate_against_kubernetes_schemas() -> None:
    """The examples' built-in kinds (the vLLM Deployment) pass Kubernetes' own schemas."""
    builtin = [
        d
        for path in sorted((DEPLOY / "examples").glob("kubernetes/*.yaml"))
        for d in load_all(path)
        if d["apiVersion"] in ("v1", "apps/v1")
    ]
    assert builtin
    for obj in builtin:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("kind", "spec", "field"),
    [
        (
            "InferenceModel",
            {"modelName": "m", "poolRef": {"name": "p"}, "criticality": "Urgent"},
            "criticality",
        ),
        ("InferenceModel", {"modelName": "", "poolRef": {"name": "p"}}, "modelName"),
        ("InferenceModel", {"modelName": "m" * 257, "poolRef": {"name": "p"}}, "modelName"),
        (
            "InferenceModel",
            {
                "modelName": "m",
                "poolRef": {"name": "p"},
                "targetModels": [{"name": "a", "weight": -1}],
            },
            "weight",
        ),
        ("InferenceModel", {"modelName": "m"}, "poolRef"),
        ("InferenceObjective", {"poolRef": {"name": "p"}, "priority": "high"}, "priority"),
        ("InferenceObjective", {"poolRef": {"name": "p"}, "priority": 2**31}, "priority"),
        ("InferenceObjective", {"priority": 1}, "poolRef"),
        ("InferencePool", {"selector": {"app": "x"}, "targetPortNumber": 0}, "targetPortNumber"),
        (
            "InferencePool",
            {"selector": {"app": "x"}, "targetPortNumber": 70000},
            "targetPortNumber",
        ),
        ("InferencePool", {"selector": {}, "targetPortNumber": 8000}, "selector"),
        (
            "InferencePool",
            {
                "selector": {"app": "x"},
                "targetPortNumber": 8000,
                "extensionRef": {"name": "e", "failureMode": "Maybe"},
            },
            "failureMode",
        ),
    ],
)
def test_crd_bounds_refuse_out_of_range_fields(kind: str, spec: dict[str, Any], field: str) -> None:
    """The CRDs' OpenAPI bounds refuse bad enums, lengths, weights and ports."""
    obj = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": spec,
    }
    with pytest.raises(jsonschema.ValidationError) as info:
        jsonschema.validate(obj, _schema_for(obj))
    assert field in "/".join(map(str, info.value.absolute_path)) + info.value.message


def test_v1_pool_crd_needs_endpoint_picker_ref_and_bounded_ports() -> None:
    """The v1 InferencePool requires endpointPickerRef and one to eight target ports."""
    schema = crd_schema("inference.networking.k8s.io", "inferencepools", "v1")
    good: dict[str, Any] = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }
    jsonschema.validate(good, schema)
    bad_specs: tuple[dict[str, Any], ...] = (
        {**good["spec"], "targetPorts": []},
        {**good["spec"], "targetPorts": [{"number": p} for p in range(8000, 8009)]},
        {k: v for k, v in good["spec"].items() if k != "endpointPickerRef"},
    )
    for bad_spec in bad_specs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": bad_spec}, schema)


def _final_stage(dockerfile: str) -> list[str]:
    lines = [
        line.strip()
        for line in re.sub(r"\\\n", " ", dockerfile).splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    starts = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    assert len(starts) >= 2, "a multi-stage build"
    return lines[starts[-1] :]


def test_dockerfile_final_stage_is_non_root_and_has_no_build_tools() -> None:
    """The image's last stage runs as a non-root user and installs no compilers or packages."""
    stage = _final_stage((ROOT / "Dockerfile").read_text())
    assert "slim" in stage[0]
    users = [line.split()[1] for line in stage if line.upper().startswith("USER ")]
    assert users, "the final stage sets USER"
    assert users[-1].split(":")[0] not in ("0", "root")
    text = "\n".join(stage).lower()
    for tool in ("apt-get", "apk ", "gcc", "build-essential", "pip install", "make "):
        assert tool not in text, tool
    assert any(line.upper().startswith("COPY --FROM=") for line in stage)


def test_the_image_runs_the_python_the_tests_run_on() -> None:
    """Every stage's base is the interpreter these tests run on: the drain of the grpclib
    server (the default before h2) once hung on Python 3.12 alone (asyncio's server waits there
    for every connection) while the tests ran on 3.11. Moving the image to another Python
    means running the tests on it first."""
    bases = re.findall(r"^FROM python:(\d+\.\d+)-slim", (ROOT / "Dockerfile").read_text(), re.M)
    assert len(bases) >= 2
    assert set(bases) == {f"{sys.version_info.major}.{sys.version_info.minor}"}


# -- deploy/examples/kubernetes/envoy-gateway ---------------------------------------------------

ENVOY_GATEWAY = DEPLOY / "examples" / "kubernetes" / "envoy-gateway"
# The kinds kubernetes-validate has no schema for (Gateway API and Envoy Gateway CRDs).
CRD_KINDS = {"GatewayClass", "Gateway", "HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"}
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_CONFIGURATION = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# Envoy Gateway's extProc body modes and the Envoy BodySendMode each becomes.
EG_BODY_MODES = {
    "Streamed": "STREAMED",
    "Buffered": "BUFFERED",
    "BufferedPartial": "BUFFERED_PARTIAL",
    "FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
}


@pytest.fixture(scope="module")
def envoy_gateway() -> list[dict[str, Any]]:
    return kustomize(ENVOY_GATEWAY)


def _only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def _namespace(objects: list[dict[str, Any]]) -> str:
    """The one namespace of the namespaced objects (unset: `default`, what the patch assumes)."""
    (namespace,) = {
        o["metadata"].get("namespace", "default") for o in objects if o["kind"] != "GatewayClass"
    }
    return str(namespace)


def _epp_settings(
    rendered: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> tuple[Settings, dict[str, Any]]:
    """The settings deploy/kubernetes's Deployment gives the EPP, and its container."""
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    monkeypatch.setenv("NAMESPACE", "serving")
    return settings_from_args(build_parser().parse_args(container["args"])), container


def test_envoy_gateway_kustomization_renders_every_file_once(
    envoy_gateway: list[dict[str, Any]],
) -> None:
    """`kubectl kustomize deploy/examples/kubernetes/envoy-gateway` renders every YAML file of
    the directory: the GatewayClass, the Gateway, the placeholder Service, the HTTPRoute and the
    two policies, once each; no namespace is forced onto the cluster-scoped GatewayClass."""
    kustomization = yaml.safe_load((ENVOY_GATEWAY / "kustomization.yaml").read_text())
    files = sorted(p.name for p in ENVOY_GATEWAY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files
    assert sorted(o["kind"] for o in envoy_gateway) == sorted([*CRD_KINDS, "Service"])
    assert "namespace" not in _only(envoy_gateway, "GatewayClass")["metadata"]


def test_envoy_gateway_objects_validate_where_kubernetes_validate_has_schemas(
    envoy_gateway: list[dict[str, Any]],
) -> None:
    """kubernetes-validate (strict) checks every rendered object it has a schema for, which here
    is only the placeholder Service: it ships no Gateway API (GatewayClass, Gateway, HTTPRoute)
    or Envoy Gateway schemas. Those kinds are pinned, so this fails once it learns one of them
    (then validate it too); their fields are checked against each other by the tests below."""
    unknown = set()
    for obj in envoy_gateway:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown.add(obj["kind"])
    assert unknown == CRD_KINDS


def test_envoy_gateway_route_matches_exactly_the_paths_the_epp_routes(
    envoy_gateway: list[dict[str, Any]],
) -> None:
    """One rule, Exact matches on the EPP's inference paths, /v1/models and /health (nothing
    else: the model servers' admin API stays shut), to the placeholder Service on a port it has."""
    route = _only(envoy_gateway, "HTTPRoute")
    (rule,) = route["spec"]["rules"]  # rule/0 in patch-policy.yaml
    paths = [m["path"] for m in rule["matches"]]
    assert {p["type"] for p in paths} == {"Exact"}
    values = [p["value"] for p in paths]
    assert len(values) == len(set(values))
    assert set(values) == {*INFERENCE_PATHS, MODELS_PATH, HEALTH_PATH}
    service = _only(envoy_gateway, "Service")
    (backend,) = rule["backendRefs"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}


def test_envoy_gateway_extension_policy_calls_the_epp_on_its_ext_proc_port(
    envoy_gateway: list[dict[str, Any]],
    rendered: dict[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The EnvoyExtensionPolicy targets the directory's HTTPRoute and calls deploy/kubernetes's
    Service on the port that reaches the EPP's --grpc-port, in body modes the EPP routes on,
    fail closed, health-checked on the ext_proc service."""
    policy = _only(envoy_gateway, "EnvoyExtensionPolicy")["spec"]
    route = _only(envoy_gateway, "HTTPRoute")
    assert policy["targetRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "HTTPRoute",
            "name": route["metadata"]["name"],
        }
    ]
    (ext_proc,) = policy["extProc"]
    (ref,) = ext_proc["backendRefs"]
    assert (ref.get("group", ""), ref.get("kind", "Service")) == ("", "Service")
    service = rendered["Service"]
    assert ref["name"] == service["metadata"]["name"]
    settings, container = _epp_settings(rendered, monkeypatch)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    ext_proc_ports = {
        p["port"]
        for p in service["spec"]["ports"]
        if named.get(p["targetPort"], p["targetPort"]) == settings.server.grpc_port
    }
    assert ref["port"] in ext_proc_ports
    mode = ext_proc["processingMode"]
    routable = {stream.FULL_DUPLEX, stream.BUFFERED}
    body_mode = processing_mode_pb2.ProcessingMode.BodySendMode.Value
    assert body_mode(EG_BODY_MODES[mode["request"]["body"]]) in routable
    assert mode["response"]["body"] in EG_BODY_MODES  # response headers and body reach the EPP
    assert mode["allowModeOverride"] is True
    assert ext_proc["failOpen"] is False
    assert ext_proc["messageTimeout"]
    active = ext_proc["backendSettings"]["healthCheck"]["active"]
    assert (active["type"], active["grpc"]["service"]) == ("GRPC", wire.EXT_PROC_SERVICE)


def test_envoy_gateway_patch_policy_names_what_the_other_files_create(
    envoy_gateway: list[dict[str, Any]],
    rendered: dict[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The EnvoyPatchPolicy targets the Gateway; its route-configuration name is the Gateway's
    `<namespace>/<name>/<listener>` for the listener the HTTPRoute attaches to; it re-points that
    route's rule-0 cluster to an ORIGINAL_DST cluster reading the EPP's destination header; and
    it adds TLS to the ext_proc cluster exactly when the EPP serves TLS."""
    namespace = _namespace(envoy_gateway)
    gateway_class = _only(envoy_gateway, "GatewayClass")
    gateway = _only(envoy_gateway, "Gateway")
    route = _only(envoy_gateway, "HTTPRoute")
    extension = _only(envoy_gateway, "EnvoyExtensionPolicy")
    spec = _only(envoy_gateway, "EnvoyPatchPolicy")["spec"]

    assert (
        gateway_class["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    )
    assert gateway["spec"]["gatewayClassName"] == gateway_class["metadata"]["name"]
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gateway["metadata"]["name"]
    (listener,) = [li for li in gateway["spec"]["listeners"] if li["name"] == parent["sectionName"]]
    assert (listener["protocol"], listener["port"]) == ("HTTP", 80)

    assert spec["type"] == "JSONPatch"
    assert spec["targetRef"] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": gateway["metadata"]["name"],
    }
    patches = spec["jsonPatches"]
    assert {p["type"] for p in patches} == {CLUSTER, ROUTE_CONFIGURATION}
    clusters = {p["name"]: p["operation"] for p in patches if p["type"] == CLUSTER}
    (route_patch,) = [p for p in patches if p["type"] == ROUTE_CONFIGURATION]
    assert route_patch["name"] == f"{namespace}/{gateway['metadata']['name']}/{listener['name']}"
    repoint = route_patch["operation"]
    assert (repoint["op"], repoint["path"]) == ("replace", "/route/cluster")
    rule_cluster = f"httproute/{namespace}/{route['metadata']['name']}/rule/0"
    assert f"@.route.cluster=='{rule_cluster}'" in repoint["jsonPath"]

    added = clusters[repoint["value"]]
    assert (added["op"], added["path"]) == ("add", "")
    cluster = added["value"]
    assert cluster["name"] == repoint["value"]
    assert (cluster["type"], cluster["lb_policy"]) == ("ORIGINAL_DST", "CLUSTER_PROVIDED")
    assert cluster["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": wire.DESTINATION_ENDPOINT,
    }
    (thresholds,) = cluster["circuit_breakers"]["thresholds"]
    assert min(thresholds.values()) > 1024  # above Envoy's default

    ext_proc_cluster = f"envoyextensionpolicy/{namespace}/{extension['metadata']['name']}/extproc/0"
    assert set(clusters) <= {repoint["value"], ext_proc_cluster}
    settings, _ = _epp_settings(rendered, monkeypatch)
    assert (ext_proc_cluster in clusters) == settings.server.secure_serving
    if settings.server.secure_serving:
        tls = clusters[ext_proc_cluster]
        assert (tls["op"], tls["path"]) == ("add", "/transport_socket")
        assert tls["value"]["name"] == "envoy.transport_sockets.tls"
