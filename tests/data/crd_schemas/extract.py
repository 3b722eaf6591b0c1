"""Write one kind's openAPIV3Schema from a project's published CRD file, without its
descriptions, as the JSON the deploy tests validate the examples against (they run offline).

    python tests/data/crd_schemas/extract.py GIT_DIR REPO TAG PATH KIND VERSION > OUT.json

GIT_DIR is a clone of the GitHub repository REPO (owner/name: istio/api,
kubernetes-sigs/gateway-api, envoyproxy/gateway), TAG its release.
The JSON names the repository, tag, commit and path it came from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import yaml


def strip(node: Any) -> Any:
    """The schema without `description` texts (the bulk of the files; nothing validates them)."""
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(git_dir: str, repo: str, tag: str, path: str, kind: str, version: str) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", git_dir, *args], capture_output=True, text=True, check=True
        ).stdout

    commit = git("rev-list", "-n1", tag).strip()
    for doc in yaml.safe_load_all(git("show", f"{tag}:{path}")):
        if doc and doc.get("kind") == "CustomResourceDefinition":
            spec = doc["spec"]
            if spec["names"]["kind"] != kind:
                continue
            for v in spec["versions"]:
                if v["name"] == version:
                    out = {
                        "source": {"repository": repo, "tag": tag, "commit": commit, "path": path},
                        "group": spec["group"],
                        "kind": kind,
                        "version": version,
                        "scope": spec["scope"],
                        "schema": strip(v["schema"]["openAPIV3Schema"]),
                    }
                    json.dump(out, sys.stdout, indent=None, sort_keys=True, separators=(",", ":"))
                    sys.stdout.write("\n")
                    return
    raise SystemExit(f"no {kind} {version} in {path} at {tag}")


if __name__ == "__main__":
    main(*sys.argv[1:])
