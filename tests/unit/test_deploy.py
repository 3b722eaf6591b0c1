"""The deployment artefacts: the kustomize base renders and validates, the CRDs hold the
examples, the Deployment's arguments parse, the metrics port's RBAC and the ServiceMonitor agree
with the server, the Envoy Gateway wiring agrees with the EPP and the other files, the
Dockerfile runs as non-root without build tools."""

from __future__ import annotations

import re
import sys
import tomllib
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed
import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests.support.deploy import (
    DEPLOY,
    EXAMPLES,
    K8S_VERSION,
    ROOT,
    kustomize,
    kustomize_text,
    load_all,
    named,
    pod_args,
    strict,
)

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.extproc import stream, wire
from endpoint_picker.requests import HEALTH_PATH, INFERENCE_PATHS, MODELS_PATH
from endpoint_picker.settings import MetricsAuth, Settings
from endpoint_picker.status.server import OPEN_PATHS, OPEN_PREFIX, MetricsServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def rendered_all() -> list[dict[str, Any]]:
    """Every object `kubectl kustomize deploy/kubernetes` renders."""
    return kustomize(DEPLOY / "kubernetes")


@pytest.fixture(scope="module")
def rendered(rendered_all: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rendered objects by kind (of the kinds with several objects, the last)."""
    return {d["kind"]: d for d in rendered_all}


@pytest.fixture(scope="module")
def cluster_roles() -> list[dict[str, Any]]:
    """The ClusterRoles every EPP shares, `kubectl kustomize deploy/kubernetes/cluster`."""
    return kustomize(DEPLOY / "kubernetes" / "cluster")


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    """The CRDs as `kubectl apply -k deploy/crds` installs them (upstream's, patched)."""
    return kustomize(DEPLOY / "crds")


def crd_schema(crds: list[dict[str, Any]], group: str, plural: str, version: str) -> Any:
    """The strict schema of one version of one of the rendered CRDs."""
    for doc in crds:
        spec = doc["spec"]
        if spec["group"] == group and spec["names"]["plural"] == plural:
            for v in spec["versions"]:
                if v["name"] == version:
                    return strict(v["schema"]["openAPIV3Schema"])
    raise AssertionError(f"no CRD for {plural}.{group}/{version}")


def test_kustomize_base_renders_the_expected_objects(rendered_all: list[dict[str, Any]]) -> None:
    """kubectl kustomize deploy/kubernetes gives exactly the EPP's objects: its five, and the
    metrics port's ClusterRoleBinding (the ClusterRoles are deploy/kubernetes/cluster's)."""
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered_all) == [
        ("ClusterRoleBinding", "endpoint-picker:default:metrics-auth"),
        ("Deployment", "endpoint-picker"),
        ("Role", "endpoint-picker"),
        ("RoleBinding", "endpoint-picker"),
        ("Service", "endpoint-picker"),
        ("ServiceAccount", "endpoint-picker"),
    ]


def test_rendered_objects_and_crds_validate_against_kubernetes_schemas(
    rendered_all: list[dict[str, Any]],
    cluster_roles: list[dict[str, Any]],
    crds: list[dict[str, Any]],
) -> None:
    """Every rendered object, shared ClusterRole and CRD passes Kubernetes' own schemas
    (strict)."""
    assert len(crds) == 4
    for obj in [*rendered_all, *cluster_roles, *crds]:
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
    """The Deployment's arguments, as the kubelet expands them, are valid `epp` flags selecting
    the Kubernetes source and the pool its label names."""
    monkeypatch.setenv("NAMESPACE", "serving")  # what the downward API sets
    settings = settings_from_args(build_parser().parse_args(pod_args(rendered["Deployment"])))
    assert settings.pool.pool_file is None
    assert settings.pool.pool_name == "vllm-llama3-8b"
    assert settings.pool.kubernetes.namespace == "serving"
    assert settings.server.metrics_endpoint.auth is MetricsAuth.KUBERNETES
    # one process on h2, which needs no worker turnover (grpcio leaked on reset streams)
    assert settings.server.worker_max_requests == 0
    assert settings.server.ext_proc_server == "h2"
    assert not settings.server.supervised


def test_metrics_auth_rbac_lets_the_epp_review_tokens_and_nothing_more(
    rendered_all: list[dict[str, Any]], cluster_roles: list[dict[str, Any]]
) -> None:
    """The EPP's ServiceAccount may create tokenreviews and subjectaccessreviews (cluster-wide
    kinds: the shared ClusterRole, bound by the overlay's ClusterRoleBinding), nothing else;
    the binding follows the ServiceAccount into the overlay's namespace."""
    role = named(cluster_roles, "ClusterRole", "endpoint-picker-metrics-auth")
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
    (binding,) = [o for o in rendered_all if o["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "endpoint-picker-metrics-auth",
    }
    account = named(rendered_all, "ServiceAccount", "endpoint-picker")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "default"}
    ]
    overlay = kustomize_text("resources: [{deploy}/kubernetes]\nnamespace: serving\n")
    (binding,) = [o for o in overlay if o["kind"] == "ClusterRoleBinding"]
    (subject,) = binding["subjects"]
    assert subject["namespace"] == "serving"


def test_metrics_reader_role_grants_get_on_every_guarded_path_of_the_port(
    cluster_roles: list[dict[str, Any]],
) -> None:
    """endpoint-picker-metrics-reader allows `get` on exactly the metrics port's routes that
    need a token (the server's routes but the open probes and page files): what Prometheus and
    the status page read, so a new route cannot be forgotten here."""
    role = named(cluster_roles, "ClusterRole", "endpoint-picker-metrics-reader")
    (rule,) = role["rules"]
    assert rule["verbs"] == ["get"]
    server = MetricsServer(lambda: b"", None)  # type: ignore[arg-type]  # routes only
    routes = {r.resource.canonical for r in server.application().router.routes() if r.resource}
    guarded = {r for r in routes if r not in OPEN_PATHS and not r.startswith(OPEN_PREFIX)}
    assert guarded == {"/metrics", "/api/status"}
    assert set(rule["nonResourceURLs"]) == guarded


def test_rbac_is_namespaced_and_read_only(rendered: dict[str, dict[str, Any]]) -> None:
    """The Role only lists and watches pods, the v1 pool and the inference kinds (the source
    never gets one object); it is bound to the EPP."""
    rules = rendered["Role"]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"list", "watch"}
    assert {(g, res) for r in rules for g in r["apiGroups"] for res in r["resources"]} == {
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferencemodels"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
    }
    binding = rendered["RoleBinding"]
    assert binding["subjects"][0]["name"] == rendered["ServiceAccount"]["metadata"]["name"]
    assert (
        rendered["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
        == (rendered["ServiceAccount"]["metadata"]["name"])
    )


def render_ha() -> list[dict[str, Any]]:
    """deploy/kubernetes with the ha component, in an overlay."""
    return kustomize_text(
        "resources: [{deploy}/kubernetes]\ncomponents: [{deploy}/kubernetes/ha]\n"
    )


def test_ha_component_adds_two_replicas_leader_election_and_lease_rbac() -> None:
    """deploy/kubernetes/ha in an overlay: two replicas, the flag (which parses), and lease
    verbs in a Role of their own; every object still validates."""
    objects = render_ha()
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    settings = settings_from_args(build_parser().parse_args(pod_args(deployment)))
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


@pytest.fixture(scope="module")
def monitoring() -> list[dict[str, Any]]:
    return kustomize(EXAMPLES / "monitoring")


def test_service_monitor_example_scrapes_the_service_with_a_reader_token(
    monitoring: list[dict[str, Any]],
    rendered_all: list[dict[str, Any]],
    cluster_roles: list[dict[str, Any]],
) -> None:
    """deploy/examples/kubernetes/monitoring: its ServiceAccount, token Secret and
    ClusterRoleBinding pass Kubernetes' schemas; the binding gives that ServiceAccount the
    shared metrics-reader role; the ServiceMonitor selects the base's Service by its labels,
    scrapes a port the Service names at /metrics, and sends the Secret's token as a bearer
    token; the PodMonitor selects the EPP's pods and sends the same token."""
    docs = monitoring
    for doc in docs:
        if doc["kind"] not in ("ServiceMonitor", "PodMonitor"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    account = named(docs, "ServiceAccount", "endpoint-picker-metrics-scraper")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["type"] == "kubernetes.io/service-account-token"
    annotation = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert annotation == account["metadata"]["name"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    reader = named(cluster_roles, "ClusterRole", "endpoint-picker-metrics-reader")
    assert binding["roleRef"]["name"] == reader["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
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
    (pod_monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert pod_endpoint["authorization"] == bearer
    pod_labels = named(rendered_all, "Deployment", "endpoint-picker")["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= (
        pod_labels["metadata"]["labels"].items()
    )


INFERENCE_KINDS = ("InferencePool", "InferenceModel", "InferenceObjective")


def _example_objects() -> list[dict[str, Any]]:
    """The inference objects of the examples: the walkthrough's (v1 pool), its v1alpha2
    variant's, and deploy/examples/pool.yaml's."""
    docs = [
        *load_all(DEPLOY / "examples" / "pool.yaml"),
        *kustomize(EXAMPLES / "pool"),
        *kustomize(EXAMPLES / "v1alpha2"),
    ]
    return [d for d in docs if d["kind"] in INFERENCE_KINDS]


def _schema_for(crds: list[dict[str, Any]], obj: dict[str, Any]) -> Any:
    group, version = obj["apiVersion"].split("/")
    return crd_schema(crds, group, obj["kind"].lower() + "s", version)


def test_example_pools_and_models_validate_against_the_repo_crds(
    crds: list[dict[str, Any]],
) -> None:
    """Every example InferencePool (v1 and v1alpha2), InferenceModel and InferenceObjective
    satisfies the CRD schema deploy/crds installs, strictly (no field the CRD lacks)."""
    objects = _example_objects()
    assert {(o["kind"], o["apiVersion"]) for o in objects} == {
        ("InferencePool", "inference.networking.k8s.io/v1"),
        ("InferencePool", "inference.networking.x-k8s.io/v1alpha2"),
        ("InferenceModel", "inference.networking.x-k8s.io/v1alpha2"),
        ("InferenceObjective", "inference.networking.x-k8s.io/v1alpha2"),
    }
    for obj in objects:
        jsonschema.validate(obj, _schema_for(crds, obj))


def test_example_workloads_validate_against_kubernetes_schemas() -> None:
    """The walkthrough's built-in kinds (the vLLM Deployment, the EPP's objects) pass
    Kubernetes' own schemas."""
    builtin = [d for d in kustomize(EXAMPLES / "pool") if d["kind"] not in INFERENCE_KINDS]
    assert {"Deployment", "Service"} <= {d["kind"] for d in builtin}
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
        ("InferenceModel", {"modelName": "m" * 257, "poolRef": {"name": "p"}}, "modelName"),
        ("InferenceModel", {"modelName": "m"}, "poolRef"),
        (
            "InferenceModel",
            {
                "modelName": "m",
                "poolRef": {"name": "p"},
                "objective": {"desiredAveragePerOutputTokenLatencyAtP95OverMultipleRequests": "x"},
            },
            "objective",
        ),
        ("InferenceObjective", {"poolRef": {"name": "p"}, "priority": "high"}, "priority"),
        ("InferenceObjective", {"priority": 1}, "poolRef"),
        (
            "InferencePool",
            {"selector": {"app": "x"}, "targetPortNumber": 0, "extensionRef": {"name": "e"}},
            "targetPortNumber",
        ),
        (
            "InferencePool",
            {"selector": {"app": "x"}, "targetPortNumber": 70000, "extensionRef": {"name": "e"}},
            "targetPortNumber",
        ),
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
def test_crd_bounds_refuse_out_of_range_fields(
    crds: list[dict[str, Any]], kind: str, spec: dict[str, Any], field: str
) -> None:
    """The CRDs' OpenAPI bounds refuse bad enums, lengths, ports and objectives."""
    obj = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": spec,
    }
    with pytest.raises(jsonschema.ValidationError) as info:
        jsonschema.validate(obj, _schema_for(crds, obj))
    assert field in "/".join(map(str, info.value.absolute_path)) + info.value.message


def test_v1_pool_crd_bounds_its_target_ports(crds: list[dict[str, Any]]) -> None:
    """The v1 InferencePool requires a selector and one to eight target ports."""
    schema = crd_schema(crds, "inference.networking.k8s.io", "inferencepools", "v1")
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
        {k: v for k, v in good["spec"].items() if k != "selector"},
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


def _lock() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock: each pinned name (normalized) -> (version, its sha256 hashes)."""
    text = re.sub(r"\\\n", " ", (ROOT / "requirements.lock").read_text())
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement, *options = line.split()
            name, version = requirement.split("==")
            hashes = [o.removeprefix("--hash=sha256:") for o in options]
            assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), requirement
            pins[canonicalize_name(name)] = (version, hashes)
    return pins


def test_dependencies_are_locked_with_hashes_for_every_requirement() -> None:
    """requirements.lock pins every runtime dependency of pyproject.toml and its build backend
    to one version that satisfies pyproject's bounds, each with its files' hashes: a dependency
    added to pyproject.toml without `make lock` fails here."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [
        *pyproject["project"]["dependencies"],
        *pyproject["build-system"]["requires"],
    ]
    pins = _lock()
    for text in wanted:
        requirement = Requirement(text)
        version, hashes = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), (text, version)
        assert hashes, text


def test_the_image_is_reproducible() -> None:
    """Every stage starts from the same base pinned by digest; the locked dependencies are
    installed with --require-hashes in a layer before the source is copied (a source edit
    reuses it), the package after it without resolving anything again; local build leftovers
    (egg-info) never reach the build context."""
    dockerfile = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip()[:1] not in ("", "#")]
    bases = [line.split()[1] for line in lines if line.upper().startswith("FROM ")]
    assert len(bases) >= 2
    assert len(set(bases)) == 1
    assert re.fullmatch(r"python:\d+\.\d+-slim@sha256:[0-9a-f]{64}", bases[0])
    copy_lock = lines.index("COPY requirements.lock ./")
    install = next(i for i, line in enumerate(lines) if "-r requirements.lock" in line)
    copy_source = next(i for i, line in enumerate(lines) if line.startswith("COPY src"))
    assert copy_lock < install < copy_source
    assert "--require-hashes" in lines[install]
    (package,) = [line for line in lines[copy_source:] if "pip install" in line]
    assert "--no-deps" in package
    assert "--no-build-isolation" in package
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "**/*.egg-info" in ignored
    assert "requirements.lock" not in ignored


# -- deploy/examples/kubernetes/envoy-gateway ---------------------------------------------------

ENVOY_GATEWAY = EXAMPLES / "envoy-gateway"
# The kinds kubernetes-validate has no schema for (Gateway API and Envoy Gateway CRDs).
CRD_KINDS = {"Gateway", "HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"}
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
    """The one namespace of the rendered objects (the kustomization's `namespace:`)."""
    (namespace,) = {o["metadata"]["namespace"] for o in objects}
    return str(namespace)


def _epp_settings(
    rendered: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> tuple[Settings, dict[str, Any]]:
    """The settings deploy/kubernetes's Deployment gives the EPP, and its container."""
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    monkeypatch.setenv("NAMESPACE", "serving")
    args = pod_args(rendered["Deployment"])
    return settings_from_args(build_parser().parse_args(args)), container


def test_envoy_gateway_kustomization_renders_every_file_once(
    envoy_gateway: list[dict[str, Any]],
) -> None:
    """`kubectl kustomize deploy/examples/kubernetes/envoy-gateway` renders every YAML file of
    the directory but the cluster-scoped GatewayClass (applied on its own, so that the
    kustomization's namespace is not forced onto it): the Gateway, the placeholder Service,
    the HTTPRoute, the two policies and the NetworkPolicy, once each."""
    kustomization = yaml.safe_load((ENVOY_GATEWAY / "kustomization.yaml").read_text())
    files = sorted(p.name for p in ENVOY_GATEWAY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(set(files) - {"gatewayclass.yaml"})
    assert sorted(o["kind"] for o in envoy_gateway) == sorted(
        [*CRD_KINDS, "Service", "NetworkPolicy"]
    )
    (gateway_class,) = load_all(ENVOY_GATEWAY / "gatewayclass.yaml")
    assert gateway_class["kind"] == "GatewayClass"


def test_envoy_gateway_objects_validate_where_kubernetes_validate_has_schemas(
    envoy_gateway: list[dict[str, Any]],
) -> None:
    """kubernetes-validate (strict) checks every rendered object it has a schema for, which here
    is only the placeholder Service and the NetworkPolicy: it ships no Gateway API (Gateway,
    HTTPRoute) or Envoy Gateway schemas. Those kinds are pinned, so this fails once it learns
    one of them; test_deploy_cluster.py validates them against their projects' published CRD
    schemas, and the tests below check their fields against each other."""
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
    (gateway_class,) = load_all(ENVOY_GATEWAY / "gatewayclass.yaml")
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
