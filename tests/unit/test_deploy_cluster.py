"""What would break or bite on a real cluster (issue 37), checked offline on what `kubectl
kustomize` renders: the CRDs are upstream's at a pinned release (the v1 one approved for its
protected group), HA rollouts finish, v1 is the default, two pools never cross-wire, cluster-
scoped names carry the namespace, the drain covers long generations, readiness tolerates a slow
probe, the Istio, GKE and Envoy Gateway wiring names what exists, and the documented walkthrough
converges on one namespace and one pool."""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs installed
import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from tests.support.deploy import (
    DEPLOY,
    EXAMPLES,
    K8S_VERSION,
    ROOT,
    Obj,
    kustomize,
    kustomize_text,
    load_all,
    named,
    only,
    pod_args,
    published_schema,
)

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.settings import GROUP_V1, GROUP_V1ALPHA2, KubernetesSettings, Settings

pytestmark = pytest.mark.timeout(60)

CRDS = DEPLOY / "crds"
NAMESPACE = "my-namespace"  # the walkthrough's
POOL = "vllm-llama3-8b"
POOL_LABEL = "endpoint-picker/pool"


def parse(args: list[str]) -> Settings:
    return settings_from_args(build_parser().parse_args(args))


# -- 1. the CRDs: upstream's bytes at a pinned release, the v1 one approved --------------------

HEADER = re.compile(
    r"# release (?P<release>v\d+\.\d+\.\d+) \(commit (?P<commit>[0-9a-f]{40})\),\n"
    r"# config/crd/bases/(?P<file>\S+)\n"
    r"# \(git blob (?P<blob>[0-9a-f]{40});"
)


def upstream_file(path: Path) -> tuple[dict[str, str], bytes]:
    """A CRD file's header fields and the bytes below its header (its leading comments)."""
    text = path.read_bytes()
    lines = text.splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if not line.startswith(b"#"))
    match = HEADER.search(b"".join(lines[:n]).decode())
    assert match, f"{path.name}: no header naming the upstream release, commit and blob"
    return match.groupdict(), b"".join(lines[n:])


def git_blob_id(data: bytes) -> str:
    """What `git hash-object` prints for these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def crd_files() -> list[Path]:
    kustomization = yaml.safe_load((CRDS / "kustomization.yaml").read_text())
    return [CRDS / name for name in kustomization["resources"]]


@pytest.fixture(scope="module")
def crds() -> list[Obj]:
    return kustomize(CRDS)


def test_crd_files_are_upstream_bytes_at_a_pinned_release() -> None:
    """Every CRD file deploy/crds installs is, below its header, byte for byte the upstream
    file the header names (its git blob id at that release's commit): drift from upstream
    fails here."""
    files = crd_files()
    assert len(files) == 4
    for path in files:
        fields, body = upstream_file(path)
        assert fields["file"] == path.name
        assert git_blob_id(body) == fields["blob"], f"{path.name} differs from upstream"


def test_protected_group_crds_carry_the_api_approval_annotation(crds: list[Obj]) -> None:
    """The API server refuses to create (or update) a CRD of a *.k8s.io group without the
    api-approved.kubernetes.io annotation: the v1 InferencePool has upstream's, naming the
    approving pull request."""
    protected = [
        c
        for c in crds
        if c["spec"]["group"].endswith((".k8s.io", ".kubernetes.io"))
        and not c["spec"]["group"].endswith(".x-k8s.io")
    ]
    assert [c["metadata"]["name"] for c in protected] == [
        "inferencepools.inference.networking.k8s.io"
    ]
    for crd in protected:
        approval = crd["metadata"]["annotations"]["api-approved.kubernetes.io"]
        assert approval.startswith(
            "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/"
        )


def test_rendered_crds_are_upstream_plus_only_the_objective_patch(crds: list[Obj]) -> None:
    """What `kubectl apply -k deploy/crds` installs is upstream's CRDs unchanged but for
    objective-patch.yaml's one optional field, spec.objective, on InferenceModel and
    InferenceObjective: a cluster with upstream's CRDs keeps every field it had."""
    upstream = {}
    for path in crd_files():
        (doc,) = [d for d in yaml.safe_load_all(upstream_file(path)[1]) if d]
        upstream[doc["metadata"]["name"]] = doc
    assert sorted(c["metadata"]["name"] for c in crds) == sorted(upstream)
    patched = set()
    for crd in crds:
        name = crd["metadata"]["name"]
        (version,) = crd["spec"]["versions"]
        spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        objective = spec_schema["properties"].pop("objective", None)
        if objective is not None:
            patched.add(crd["spec"]["names"]["kind"])
            assert objective["required"] == [
                "desiredAveragePerOutputTokenLatencyAtP95OverMultipleRequests"
            ]
            assert "objective" not in spec_schema.get("required", [])
        assert crd == upstream[name], f"{name} differs from upstream beyond the patch"
    assert patched == {"InferenceModel", "InferenceObjective"}


# -- 2. HA rollouts finish -----------------------------------------------------------------


def resolve(value: int | str, replicas: int, *, round_up: bool) -> int:
    """An int-or-percent of a rolling update, as the Deployment controller resolves it."""
    if isinstance(value, int):
        return value
    share = replicas * int(value.removesuffix("%")) / 100
    return math.ceil(share) if round_up else math.floor(share)


def rollout_finishes(replicas: int, strategy: Obj, steps: int = 50) -> bool:
    """Whether the Deployment controller replaces every pod of an active-passive EPP: the
    arithmetic of its rolling update (pkg/controller/deployment/rolling.go: scale the new
    ReplicaSet up within maxSurge; scale old pods down, unready ones first, while the
    available pods stay at least replicas - maxUnavailable) or of Recreate, with pods that are
    Ready only while they hold the Lease, which passes to a new pod when the old leader goes."""
    old = [True] + [False] * (replicas - 1)  # the leader, then never-Ready standbys
    new: list[bool] = []
    for _ in range(steps):
        if not old and len(new) == replicas:
            return True
        if strategy.get("type") == "Recreate":
            old = []
            new = new or [False] * replicas
        else:
            rolling = strategy.get("rollingUpdate", {})
            surge = resolve(rolling.get("maxSurge", "25%"), replicas, round_up=True)
            unavailable = resolve(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
            if surge == 0 and unavailable == 0:
                unavailable = 1  # the controller's own rule
            room = replicas + surge - len(old) - len(new)
            new += [False] * max(0, min(room, replicas - len(new)))
            min_available = replicas - unavailable
            new_unavailable = new.count(False)
            scale_down = len(old) + len(new) - min_available - new_unavailable
            for _ in range(max(0, scale_down)):
                available = old.count(True) + new.count(True)
                if False in old:
                    old.remove(False)  # cleanupUnhealthyReplicas
                elif old and available > min_available:
                    old.remove(True)
        if True not in old and new and True not in new:
            new[0] = True  # the old leader is gone: a new pod takes the Lease
    return False


def test_the_model_of_the_rollout_sticks_on_the_default_strategy() -> None:
    """The rollout model reproduces the bug: the default strategy (surge 25%, none unavailable)
    never removes the only Ready pod, the old leader, so an HA rollout never finishes; a plain
    Deployment whose new pods turn Ready would."""
    assert not rollout_finishes(2, {})
    assert not rollout_finishes(2, {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}})
    assert rollout_finishes(2, {"type": "Recreate"})


def test_ha_rollout_finishes_although_the_standby_is_never_ready() -> None:
    """The ha component's strategy lets a rollout replace both replicas while only the leader is
    ever Ready, with two replicas and with more."""
    (deployment,) = [
        o
        for o in kustomize_text(
            "resources: [{deploy}/kubernetes]\ncomponents: [{deploy}/kubernetes/ha]\n"
        )
        if o["kind"] == "Deployment"
    ]
    replicas, strategy = deployment["spec"]["replicas"], deployment["spec"]["strategy"]
    assert replicas == 2
    for n in (replicas, 3, 5):
        assert rollout_finishes(n, strategy), (n, strategy)


def test_ha_replicas_spread_over_nodes_whatever_the_pool_label() -> None:
    """The ha replicas are spread over nodes (best effort) by a constraint that counts the
    pool's own EPP pods, whatever value an overlay gives the pool label."""
    (deployment,) = [
        o
        for o in kustomize_text(
            "resources: [{deploy}/kubernetes]\ncomponents: [{deploy}/kubernetes/ha]\n"
            f"labels: [{{pairs: {{{POOL_LABEL}: other}}, includeSelectors: true}}]\n"
        )
        if o["kind"] == "Deployment"
    ]
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert POOL_LABEL in spread["matchLabelKeys"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (expression,) = spread["labelSelector"]["matchExpressions"]
    assert (expression["key"], expression["operator"]) == (POOL_LABEL, "Exists")
    assert labels[POOL_LABEL] == "other"


# -- 3. v1 by default ---------------------------------------------------------------------


def test_the_kubernetes_source_watches_the_v1_pool_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --pool-group the EPP, and the base's Deployment, watch the v1 InferencePool
    (inference.networking.k8s.io); the v1alpha2 component switches to the legacy group and
    lets the Role list it."""
    assert KubernetesSettings().group == GROUP_V1
    assert parse(["serve", "--pool-name", "p"]).pool.kubernetes.group == GROUP_V1
    base = named(kustomize(DEPLOY / "kubernetes"), "Deployment", "endpoint-picker")
    monkeypatch.setenv("NAMESPACE", "serving")
    assert "--pool-group" not in pod_args(base)
    assert parse(pod_args(base)).pool.kubernetes.group == GROUP_V1
    legacy = kustomize_text(
        "resources: [{deploy}/kubernetes]\ncomponents: [{deploy}/kubernetes/v1alpha2]\n"
    )
    assert parse(pod_args(only(legacy, "Deployment"))).pool.kubernetes.group == GROUP_V1ALPHA2
    rules = only(legacy, "Role")["rules"]
    assert any(
        GROUP_V1ALPHA2 in r["apiGroups"] and "inferencepools" in r["resources"] for r in rules
    )


def test_the_examples_use_the_v1_pool_and_endpoint_picker_ref() -> None:
    """The walkthrough's pool is a v1 InferencePool whose endpointPickerRef names the EPP's
    Service and ext_proc port; the models point at it by its group; the Istio and GKE routes
    take it as a v1 backendRef; the v1alpha2 overlay has the same pool in the legacy API."""
    objects = kustomize(EXAMPLES / "pool")
    pool = only(objects, "InferencePool")
    assert pool["apiVersion"] == f"{GROUP_V1}/v1"
    service = only(objects, "Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert ref["failureMode"] == "FailClose"
    for model in [o for o in objects if o["kind"] in ("InferenceModel", "InferenceObjective")]:
        assert model["spec"]["poolRef"] == {"group": GROUP_V1, "name": POOL}
    for gateway in ("istio", "gke"):
        (rule,) = only(kustomize(EXAMPLES / gateway), "HTTPRoute")["spec"]["rules"]
        assert rule["backendRefs"] == [{"group": GROUP_V1, "kind": "InferencePool", "name": POOL}]
    legacy = only(kustomize(EXAMPLES / "v1alpha2"), "InferencePool")
    assert legacy["apiVersion"] == f"{GROUP_V1ALPHA2}/v1alpha2"
    assert legacy["spec"]["extensionRef"]["name"] == service["metadata"]["name"]


# -- 4 and 5. two pools in one namespace; EPPs in several namespaces ------------------------


def documented_overlay() -> str:
    """The `my-epp/kustomization.yaml` docs/kubernetes.md tells users to write."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    match = re.search(r"```yaml\n(# my-epp/kustomization.yaml\n.*?)```", text, re.S)
    assert match, "docs/kubernetes.md shows no my-epp overlay"
    return match[1]


def epp_overlay(namespace: str, pool: str, suffix: str = "") -> list[Obj]:
    """The EPP of ``pool`` in ``namespace`` from the documented overlay (a second pool of a
    namespace with the nameSuffix the doc says to add)."""
    text = documented_overlay()
    assert "resources: [../deploy/kubernetes]" in text
    assert "namespace: my-namespace" in text
    assert f"{{{POOL_LABEL}: my-pool}}" in text
    text = (
        text.replace("../deploy/kubernetes", "{deploy}/kubernetes")
        .replace("namespace: my-namespace", f"namespace: {namespace}")
        .replace(f"{{{POOL_LABEL}: my-pool}}", f"{{{POOL_LABEL}: {pool}}}")
    )
    if suffix:
        text += f"nameSuffix: {suffix}\n"
    return kustomize_text(text)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_two_pools_in_one_namespace_select_only_their_own_epp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two pools' EPPs in one namespace (the second name-suffixed): each Service and each
    Deployment selects its own EPP's pods and not the other's, and each EPP watches its pool."""
    first = epp_overlay("serving", "pool-a")
    second = epp_overlay("serving", "pool-b", "-pool-b")
    deployments = [only(first, "Deployment"), only(second, "Deployment")]
    services = [only(first, "Service"), only(second, "Service")]
    assert services[0]["metadata"]["name"] != services[1]["metadata"]["name"]
    monkeypatch.setenv("NAMESPACE", "serving")
    for i, service in enumerate(services):
        for j, deployment in enumerate(deployments):
            pods = deployment["spec"]["template"]["metadata"]["labels"]
            assert selects(service["spec"]["selector"], pods) == (i == j)
            own = deployments[i]["spec"]["selector"]["matchLabels"]
            assert selects(own, pods) == (i == j)
    assert [parse(pod_args(d)).pool.pool_name for d in deployments] == ["pool-a", "pool-b"]


def test_cluster_scoped_names_carry_the_namespace_and_shared_roles_stay_apart() -> None:
    """EPPs in two namespaces, and a second pool in one of them, render no cluster-scoped
    object of the same name (an apply in one namespace never takes over another's binding);
    no overlay holds a ClusterRole (deleting one never deletes what the others bind to): each
    binding names a ClusterRole of deploy/kubernetes/cluster, applied once. The monitoring
    example's binding is namespaced the same way."""
    overlays = [
        epp_overlay("team-a", POOL),
        epp_overlay("team-b", POOL),
        epp_overlay("team-a", "other", "-other"),
    ]
    shared = {o["metadata"]["name"] for o in kustomize(DEPLOY / "kubernetes" / "cluster")}
    names = []
    for objects in overlays:
        cluster_scoped = [o for o in objects if "namespace" not in o["metadata"]]
        assert {o["kind"] for o in cluster_scoped} == {"ClusterRoleBinding"}
        for binding in cluster_scoped:
            assert binding["roleRef"]["name"] in shared
            (subject,) = binding["subjects"]
            assert f":{subject['namespace']}:" in binding["metadata"]["name"]
            names.append(binding["metadata"]["name"])
    assert len(names) == len(set(names)) == 3
    with_monitoring = [kustomize(EXAMPLES / "monitoring")]
    for other in ("team-b",):
        text = (EXAMPLES / "monitoring" / "kustomization.yaml").read_text()
        with_monitoring.append(
            kustomize_copy(EXAMPLES / "monitoring", text.replace(NAMESPACE, other))
        )
    scrapers = [only(objs, "ClusterRoleBinding")["metadata"]["name"] for objs in with_monitoring]
    assert len(set(scrapers)) == 2
    assert all(
        only(objs, "ClusterRoleBinding")["roleRef"]["name"] in shared for objs in with_monitoring
    )


def kustomize_copy(folder: Path, kustomization: str) -> list[Obj]:
    """Render a copy of an example folder with its kustomization.yaml replaced (as a user who
    changes its namespace would), in a temporary folder beside it."""
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".test-copy-") as parent:
        copy = Path(parent) / folder.name
        shutil.copytree(folder, copy)
        (copy / "kustomization.yaml").write_text(kustomization)
        return kustomize(copy)


# -- 6 and 7. the drain; the probes --------------------------------------------------------

REFERENCE_GRACE = 130  # seconds: the reference chart's terminationGracePeriodSeconds


def test_drain_and_grace_cover_the_references_130s_after_a_prestop_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On deletion the pod first pauses (preStop) while the gateway stops picking it, then
    drains open generations for at least the reference's 130 s, and the grace period covers the
    pause, the drain and a margin to exit."""
    deployment = named(kustomize(DEPLOY / "kubernetes"), "Deployment", "endpoint-picker")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause >= 5
    monkeypatch.setenv("NAMESPACE", "serving")
    drain = parse(pod_args(deployment)).server.drain_timeout
    assert drain >= REFERENCE_GRACE
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 5


def test_readiness_tolerates_a_slow_probe_and_liveness_a_busy_loop() -> None:
    """One slow or lost readiness probe never takes the only EPP out of its Service: several
    consecutive failures, each allowed at least 2 s, over at least 10 s, are needed; liveness
    is laxer still."""
    deployment = named(kustomize(DEPLOY / "kubernetes"), "Deployment", "endpoint-picker")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ready = container["readinessProbe"]
    assert ready["failureThreshold"] >= 3
    assert ready.get("timeoutSeconds", 1) >= 2
    assert ready["failureThreshold"] * ready.get("periodSeconds", 10) >= 10
    live = container["livenessProbe"]
    assert live["failureThreshold"] * live.get("periodSeconds", 10) >= 30
    assert live.get("timeoutSeconds", 1) >= ready.get("timeoutSeconds", 1)


# -- 8. gateway wiring: Istio, GKE, Envoy Gateway ------------------------------------------

# Validated against each project's published CRD schema (tests/data/crd_schemas):
PUBLISHED = {
    "Gateway",
    "HTTPRoute",
    "GatewayClass",
    "DestinationRule",
    "EnvoyExtensionPolicy",
    "EnvoyPatchPolicy",
}
# GKE publishes no CRD schema for these (they live in GKE's control plane): their fields are
# checked against what the reference's chart ships instead (the tests below).
UNPUBLISHED = {"HealthCheckPolicy", "GCPBackendPolicy"}


def validate_everything(objects: list[Obj]) -> set[str]:
    """Validate each object: built-in kinds with kubernetes-validate (strict), the others against
    their project's published CRD schema (strict: no undeclared field). Returns the kinds that
    have no published schema."""
    unpublished = set()
    for obj in objects:
        if obj["kind"] in PUBLISHED:
            schema, source = published_schema(obj["kind"])
            assert obj["apiVersion"] == f"{source['group']}/{source['version']}"
            jsonschema.validate(obj, schema)
        elif obj["kind"] in UNPUBLISHED:
            unpublished.add(obj["kind"])
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return unpublished


def test_gateway_examples_validate_against_the_published_schemas() -> None:
    """The Istio, GKE and Envoy Gateway examples (and Envoy Gateway's GatewayClass) pass the
    Gateway API's, Istio's and Envoy Gateway's own CRD schemas at the pinned releases, and
    Kubernetes' for built-in kinds; GKE's two policies are the only kinds left unvalidated."""
    unpublished = set()
    for folder in ("istio", "gke", "envoy-gateway"):
        unpublished |= validate_everything(kustomize(EXAMPLES / folder))
    unpublished |= validate_everything(load_all(EXAMPLES / "envoy-gateway" / "gatewayclass.yaml"))
    assert unpublished == UNPUBLISHED


def test_the_schema_check_refuses_an_undeclared_field() -> None:
    """The published schemas are applied strictly: a misspelt field fails, as kubectl's strict
    field validation would make it fail on a cluster."""
    rule = only(kustomize(EXAMPLES / "istio"), "DestinationRule")
    rule["spec"]["trafficPolicy"]["tls"]["insecureSkipVerfy"] = True
    schema, _ = published_schema("DestinationRule")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, schema)


def test_istio_destination_rule_gives_tls_to_the_epp_service_in_its_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DestinationRule's host is the EPP Service's cluster name in the kustomization's
    namespace, in that namespace and in another one, with TLS without verification exactly
    when the EPP serves TLS (its self-signed certificate); the route's Gateway is created."""
    epp = kustomize(EXAMPLES / "pool")
    service = only(epp, "Service")
    monkeypatch.setenv("NAMESPACE", NAMESPACE)
    secure = parse(pod_args(named(epp, "Deployment", "endpoint-picker"))).server.secure_serving
    text = (EXAMPLES / "istio" / "kustomization.yaml").read_text()
    for namespace in (NAMESPACE, "team-b"):
        objects = kustomize_copy(EXAMPLES / "istio", text.replace(NAMESPACE, namespace))
        rule = only(objects, "DestinationRule")
        assert rule["metadata"]["namespace"] == namespace
        assert (
            rule["spec"]["host"] == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
        )
        tls = rule["spec"]["trafficPolicy"]["tls"]
        assert secure  # the EPP's default: TLS with a self-signed certificate
        assert tls == {"mode": "SIMPLE", "insecureSkipVerify": True}
        route, gateway = only(objects, "HTTPRoute"), only(objects, "Gateway")
        assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
        assert gateway["spec"]["gatewayClassName"] == "istio"


def test_gke_policies_target_the_pool_and_check_its_servers_health() -> None:
    """GKE's HealthCheckPolicy and GCPBackendPolicy target the walkthrough's v1 InferencePool
    (group, kind, name), with the fields the reference's chart sets: an HTTP check of /health on
    the pool's target port, and a 300 s backend timeout; the route's Gateway is created."""
    pool = only(kustomize(EXAMPLES / "pool"), "InferencePool")
    objects = kustomize(EXAMPLES / "gke")
    target = {"group": GROUP_V1, "kind": "InferencePool", "name": pool["metadata"]["name"]}
    health = only(objects, "HealthCheckPolicy")
    backend = only(objects, "GCPBackendPolicy")
    for policy in (health, backend):
        assert policy["apiVersion"] == "networking.gke.io/v1"
        assert policy["spec"]["targetRef"] == target
        assert set(policy["spec"]) == {"targetRef", "default"}
    check = health["spec"]["default"]
    assert set(check) == {"timeoutSec", "checkIntervalSec", "config"}
    assert check["config"]["type"] == "HTTP"
    assert check["config"]["httpHealthCheck"] == {
        "requestPath": "/health",
        "port": pool["spec"]["targetPorts"][0]["number"],
    }
    assert set(backend["spec"]["default"]) == {"timeoutSec", "logging"}
    assert backend["spec"]["default"]["timeoutSec"] >= 300
    route, gateway = only(objects, "HTTPRoute"), only(objects, "Gateway")
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    assert gateway["spec"]["gatewayClassName"].startswith("gke-l7-")


def test_envoy_gateway_xds_names_follow_the_namespace() -> None:
    """The EnvoyPatchPolicy's xDS names (route configuration, rule cluster, ext_proc cluster)
    carry the kustomization's namespace, whatever it is set to: nothing hard-codes `default`."""
    text = (EXAMPLES / "envoy-gateway" / "kustomization.yaml").read_text()
    for namespace in (NAMESPACE, "team-b"):
        objects = kustomize_copy(EXAMPLES / "envoy-gateway", text.replace(NAMESPACE, namespace))
        patches = only(objects, "EnvoyPatchPolicy")["spec"]["jsonPatches"]
        names = [p["name"] for p in patches] + [p["operation"].get("jsonPath", "") for p in patches]
        assert not any("default" in n for n in names)
        assert f"{namespace}/inference-gateway/llm-gw" in names
        assert f"envoyextensionpolicy/{namespace}/endpoint-picker/extproc/0" in names
        assert any(f"'httproute/{namespace}/llm-route/rule/0'" in n for n in names)


def test_network_policies_let_only_the_gateway_open_ext_proc_streams() -> None:
    """The Istio and Envoy Gateway examples' NetworkPolicy selects the walkthrough's EPP pods
    (not the model servers), opens the ext_proc port only to the pods of the Gateway the
    example creates (Istio's gateway-name label; Envoy Gateway's owning-gateway labels, its
    namespace written in), and leaves the health and metrics ports open."""
    pool = kustomize(EXAMPLES / "pool")
    epp = named(pool, "Deployment", "endpoint-picker")["spec"]["template"]["metadata"]["labels"]
    servers = named(pool, "Deployment", POOL)["spec"]["template"]["metadata"]["labels"]
    for folder in ("istio", "envoy-gateway"):
        objects = kustomize(EXAMPLES / folder)
        policy, gateway = only(objects, "NetworkPolicy"), only(objects, "Gateway")
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selects(selector, epp)
        assert not selects(selector, servers)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        by_port: dict[int, list[Any]] = {}
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                by_port.setdefault(port["port"], []).append(rule.get("from"))
        assert sorted(by_port) == [9002, 9003, 9090]
        assert by_port[9003] == by_port[9090] == [None]  # from anywhere
        ((peer,),) = by_port[9002]
        labels = peer["podSelector"]["matchLabels"]
        name = gateway["metadata"]["name"]
        if folder == "istio":
            assert peer == {"podSelector": {"matchLabels": {ISTIO_GATEWAY_LABEL: name}}}
        else:
            assert labels == {
                "gateway.envoyproxy.io/owning-gateway-name": name,
                "gateway.envoyproxy.io/owning-gateway-namespace": NAMESPACE,
            }
            assert "namespaceSelector" in peer


ISTIO_GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"


# -- 9. the walkthrough converges ------------------------------------------------------------

KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"


def documented_commands() -> list[tuple[str, str]]:
    """Every `kubectl apply -k|-f PATH` of the walkthrough: in docs/kubernetes.md's section
    and in the README's."""
    doc = KUBERNETES_DOC.read_text()
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### Deploying on a cluster")
    sections = [
        doc[doc.index("## Deploying on a cluster") :],
        readme[start : readme.index("\n### ", start + 1)],
    ]
    pattern = r"kubectl apply (-k|-f) (deploy/\S+?)`?(?=[\s`])"
    commands = [c for section in sections for c in re.findall(pattern, section)]
    assert commands
    return list(dict.fromkeys(commands))


def test_every_documented_command_renders_and_the_names_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Render every manifest the walkthrough applies: the namespaced objects all land in one
    namespace; the EPP watches the pool that exists, by the name the models, the routes and
    the GKE policies use; the pool's endpointPickerRef names the EPP's Service; every route's
    parent Gateway is created; the monitors bind their scraper in that namespace and select the
    EPP."""
    commands = documented_commands()
    paths = {path.rstrip("/") for _, path in commands}
    for required in (
        "deploy/crds",
        "deploy/kubernetes/cluster",
        "deploy/examples/kubernetes/pool",
        "deploy/examples/kubernetes/istio",
        "deploy/examples/kubernetes/gke",
        "deploy/examples/kubernetes/envoy-gateway",
        "deploy/examples/kubernetes/monitoring",
    ):
        assert required in paths, f"docs/kubernetes.md does not apply {required}"
    rendered: dict[str, list[Obj]] = {}
    for flag, path in commands:
        target = ROOT / path.rstrip("/")
        rendered[path.rstrip("/")] = kustomize(target) if flag == "-k" else load_all(target)
    everything = [o for objects in rendered.values() for o in objects]
    namespaces = {o["metadata"]["namespace"] for o in everything if "namespace" in o["metadata"]}
    assert namespaces == {NAMESPACE}
    cluster_kinds = {
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "GatewayClass",
    }
    for obj in everything:
        assert ("namespace" in obj["metadata"]) == (obj["kind"] not in cluster_kinds), obj

    walkthrough = rendered["deploy/examples/kubernetes/pool"]
    pool = only(walkthrough, "InferencePool")
    name = pool["metadata"]["name"]
    deployment = named(walkthrough, "Deployment", "endpoint-picker")
    monkeypatch.setenv("NAMESPACE", NAMESPACE)
    settings = parse(pod_args(deployment))
    assert settings.pool.pool_name == name
    assert settings.pool.kubernetes.group == pool["apiVersion"].split("/")[0]
    service = only(walkthrough, "Service")
    assert pool["spec"]["endpointPickerRef"]["name"] == service["metadata"]["name"]
    servers = [o for o in walkthrough if o["kind"] == "Deployment" and o is not deployment]
    assert all(
        selects(
            pool["spec"]["selector"]["matchLabels"], s["spec"]["template"]["metadata"]["labels"]
        )
        for s in servers
    )
    assert not selects(
        service["spec"]["selector"], servers[0]["spec"]["template"]["metadata"]["labels"]
    )
    for obj in everything:
        if obj["kind"] in ("InferenceModel", "InferenceObjective"):
            assert obj["spec"]["poolRef"]["name"] == name
        if obj["kind"] in ("HealthCheckPolicy", "GCPBackendPolicy"):
            assert obj["spec"]["targetRef"]["name"] == name
        if obj["kind"] == "ClusterRoleBinding":
            for subject in obj["subjects"]:
                assert subject["namespace"] == NAMESPACE
                named(everything, "ServiceAccount", subject["name"])
        if obj["kind"] == "EnvoyExtensionPolicy":
            (ref,) = obj["spec"]["extProc"][0]["backendRefs"]
            assert ref["name"] == service["metadata"]["name"]
    for path, objects in rendered.items():
        for route in [o for o in objects if o["kind"] == "HTTPRoute"]:
            for parent in route["spec"]["parentRefs"]:
                named(objects, "Gateway", parent["name"])
            backends = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
            for backend in backends:
                if backend.get("kind") == "InferencePool":
                    assert backend["name"] == name, path
    monitor = only(rendered["deploy/examples/kubernetes/monitoring"], "ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    pod_monitor = only(rendered["deploy/examples/kubernetes/monitoring"], "PodMonitor")
    assert selects(
        pod_monitor["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"],
    )
