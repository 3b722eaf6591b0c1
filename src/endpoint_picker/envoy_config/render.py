"""Render one variant's template (``render``): each placeholder's value, and the blocks
(pool endpoints, routes, the EPP's TLS, the runtime layer) some of them span."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from pathlib import Path

from endpoint_picker.envoy_config import inputs
from endpoint_picker.envoy_config.inputs import (
    EnvoyConfigError,
    is_ip,
    parse_endpoint,
    quote,
    valid_address,
    valid_duration,
    valid_file,
    valid_port,
)

_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@/-]*")
_PLACEHOLDER = re.compile(r"\$\{([a-z_]+)\}")


def _endpoints_block(endpoints: Sequence[str]) -> str:
    if not endpoints:
        raise EnvoyConfigError("the fallback variant needs the pool's endpoints (--endpoint)")
    lines = []
    for text in endpoints:
        host, port = parse_endpoint(text)
        lines.append(
            f"- endpoint: {{ address: {{ socket_address: {{ address: {quote(host)}, "
            f"port_value: {port} }} }} }}"
        )
    return "\n".join(lines)


def _routes_block(extra_paths: Sequence[str]) -> str:
    """Exact-path routes that reuse the first route's action (YAML alias)."""
    paths = list(dict.fromkeys([*inputs.DEFAULT_INFERENCE_PATHS, *extra_paths]))
    lines = []
    for path in paths:
        if not _PATH.fullmatch(path) or "/../" in path or path.endswith("/.."):
            raise EnvoyConfigError(f"inference path must be an absolute URL path: {path!r}")
        if path == "/v1/completions":
            continue
        lines += [f"- match: {{ path: {quote(path)} }}", "  route: *inference_route"]
    return "\n".join(lines)


def _transport_socket(
    tls: bool,
    sni: str,
    client_cert: str | None = None,
    client_key: str | None = None,
    ca: str | None = None,
) -> str:
    if (client_cert is None) != (client_key is None):
        raise EnvoyConfigError("--epp-client-cert and --epp-client-key go together")
    if not tls:
        if client_cert is not None or ca is not None:
            raise EnvoyConfigError("--epp-client-cert, --epp-client-key, --epp-ca need --epp-tls")
        return "# Plaintext to the EPP (rendered with --no-epp-tls)."
    lines = [
        "transport_socket:",
        "  name: envoy.transport_sockets.tls",
        "  typed_config:",
        '    "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3'
        ".UpstreamTlsContext",
        f"    sni: {quote(sni)}",
        "    common_tls_context:",
        "      alpn_protocols: [h2]",
    ]
    if client_cert is not None and client_key is not None:
        # mutual TLS: the certificate the EPP's --client-ca-file must have signed
        lines += [
            "      tls_certificates:",
            f"      - certificate_chain: {valid_file(client_cert, 'epp_client_cert')}",
            f"        private_key: {valid_file(client_key, 'epp_client_key')}",
        ]
    # Without a CA the EPP's certificate (self-signed unless --cert-path gives it one) is not
    # verified: encrypted, not authenticated. With one, the chain and the SNI name are checked.
    if ca is not None:
        lines += [
            "      validation_context:",
            f"        trusted_ca: {valid_file(ca, 'epp_ca')}",
            "        match_typed_subject_alt_names:",
            f"        - {{ san_type: DNS, matcher: {{ exact: {quote(sni)} }} }}",
        ]
    return "\n".join(lines)


def _runtime_layer(graceful_close: bool) -> str:
    """Envoy's runtime guard for closing ext_proc streams gracefully, when asked for."""
    if not graceful_close:
        return (
            "# ext_proc streams end with a reset (Envoy's default); --ext-proc-graceful-close\n"
            "# would half-close them instead (docs/envoy.md, item 6: it stops a memory leak in\n"
            "# the EPP, but crashed Envoy 1.40 once in our overload runs)."
        )
    return "\n".join([
        "# Close each ext_proc stream gracefully (half-close, then wait up to 1 s for the EPP's",
        "# status) instead of resetting it: grpcio's aio server leaks native memory for every",
        "# reset stream (grpc/grpc#43360). Experimental in Envoy: see docs/envoy.md, item 6.",
        "layered_runtime:",
        "  layers:",
        "  - name: static",
        "    static_layer:",
        "      envoy.reloadable_features.ext_proc_graceful_grpc_close: true",
    ])  # fmt: skip


def substitute(template: str, values: dict[str, str]) -> str:
    """``string.Template`` substitution; multi-line values are indented to their column."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - values.keys())
    if missing:
        raise EnvoyConfigError(f"template placeholders without a value: {', '.join(missing)}")
    out: list[str] = []
    for line in template.splitlines():
        match = _PLACEHOLDER.fullmatch(line.strip())
        if match and "\n" in values[match.group(1)]:
            indent = line[: len(line) - len(line.lstrip())]
            block = values[match.group(1)].splitlines()
            out.extend(indent + b if b else "" for b in block)
            continue
        out.append(string.Template(line).substitute(values))
    return "\n".join(out) + "\n"


def load_template(variant: str, template_dir: Path | None = None) -> str:
    if variant not in inputs.VARIANTS:
        raise EnvoyConfigError(f"unknown variant {variant!r}; one of {', '.join(inputs.VARIANTS)}")
    path = (template_dir or inputs.DEFAULT_TEMPLATE_DIR) / f"{variant}.yaml"
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvoyConfigError(f"cannot read template {path}: {exc.strerror}") from exc


def render(
    variant: str,
    *,
    listen_address: str = "0.0.0.0",
    listen_port: int = 8081,
    admin_address: str = "127.0.0.1",
    admin_port: int = 19000,
    epp_address: str = "127.0.0.1",
    epp_port: int = 9002,
    epp_tls: bool = True,
    epp_sni: str = "localhost",
    epp_client_cert: str | None = None,
    epp_client_key: str | None = None,
    epp_ca: str | None = None,
    endpoints: Sequence[str] = (),
    max_request_bytes: int = inputs.DEFAULT_MAX_REQUEST_BYTES,
    failure_mode_allow: bool = False,
    message_timeout: float = inputs.DEFAULT_MESSAGE_TIMEOUT,
    stream_idle_timeout: float = inputs.DEFAULT_STREAM_IDLE_TIMEOUT,
    upstream_connect_timeout: float = inputs.DEFAULT_CONNECT_TIMEOUT,
    num_retries: int = inputs.DEFAULT_NUM_RETRIES,
    inference_paths: Sequence[str] = (),
    max_headers_count: int = inputs.DEFAULT_MAX_HEADERS_COUNT,
    ext_proc_graceful_close: bool = False,
    template_dir: Path | None = None,
) -> str:
    """The Envoy bootstrap YAML of ``variant``; ``EnvoyConfigError`` on a bad input.

    ``endpoints`` (``ip:port``) are the pool's endpoints; only ``fallback`` needs them (its
    cluster lists them statically). ``failure_mode_allow=False`` is FailClose: with the EPP
    unreachable Envoy answers 5xx instead of forwarding an unrouted request.
    ``epp_client_cert``/``epp_client_key`` (paths Envoy reads) give Envoy a client certificate
    for an EPP run with ``--client-ca-file``; ``epp_ca`` makes Envoy verify the EPP's
    certificate against that CA and ``epp_sni``.
    ``inference_paths`` are routed besides the OpenAI inference APIs (give the EPP the same
    paths with ``--extra-inference-path``); every other path is a 404 at Envoy.
    ``ext_proc_graceful_close`` turns on Envoy's runtime guard that half-closes ext_proc
    streams instead of resetting them (docs/envoy.md, item 6).
    """
    template = load_template(variant, template_dir)
    if max_request_bytes < 1:
        raise EnvoyConfigError(f"max_request_bytes must be positive: {max_request_bytes}")
    if num_retries < 0:
        raise EnvoyConfigError(f"num_retries must not be negative: {num_retries}")
    if message_timeout <= 0:
        raise EnvoyConfigError(f"message_timeout must be positive: {message_timeout}")
    if max_headers_count < 10:
        raise EnvoyConfigError(f"max_headers_count must be at least 10: {max_headers_count}")
    values = {
        "listen_address": quote(valid_address(listen_address, "listen_address")),
        "listen_port": valid_port(listen_port, "listen_port"),
        "admin_address": quote(valid_address(admin_address, "admin_address")),
        "admin_port": valid_port(admin_port, "admin_port"),
        "epp_address": quote(valid_address(epp_address, "epp_address")),
        "epp_port": valid_port(epp_port, "epp_port"),
        "epp_cluster_type": "STATIC" if is_ip(epp_address) else "STRICT_DNS",
        "epp_transport_socket": _transport_socket(
            epp_tls, valid_address(epp_sni, "epp_sni"), epp_client_cert, epp_client_key, epp_ca
        ),
        "max_request_bytes": str(max_request_bytes),
        "failure_mode_allow": "true" if failure_mode_allow else "false",
        "message_timeout": valid_duration(message_timeout, "message_timeout"),
        "stream_idle_timeout": valid_duration(stream_idle_timeout, "stream_idle_timeout"),
        "upstream_connect_timeout": valid_duration(upstream_connect_timeout, "connect_timeout"),
        "num_retries": str(num_retries),
        "inference_routes": _routes_block(inference_paths),
        "max_headers_count": str(max_headers_count),
        "pool_endpoints": _endpoints_block(endpoints) if variant == "fallback" else "",
        "runtime_layer": _runtime_layer(ext_proc_graceful_close),
    }
    return substitute(template, values)
