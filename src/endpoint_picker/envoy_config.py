"""Render the Envoy configurations under ``deploy/envoy/templates/`` (``epp envoy-config``).

Three variants, one template file each (docs/envoy.md explains them):

- ``reference``: ext_proc in FULL_DUPLEX_STREAMED mode and an ORIGINAL_DST cluster routing to
  the one address in ``x-gateway-destination-endpoint``.
- ``fallback``: the same filter chain, but a STATIC cluster of the pool's endpoints with the
  ``override_host`` load-balancing policy and a retry policy, so a failed attempt moves on to
  the next endpoint of the EPP's comma-separated list.
- ``buffered``: the reference wiring with request and response bodies BUFFERED.

The templates are plain Envoy YAML with ``${name}`` placeholders (``string.Template``). A
placeholder alone on its line whose value spans several lines (a YAML block) is indented to
the placeholder's column. This module only renders text: it imports no gRPC and no protos.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import string
import sys
from collections.abc import Sequence
from pathlib import Path

from endpoint_picker.errors import ConfigError
from endpoint_picker.types import ascii_int

VARIANTS = ("reference", "fallback", "buffered")

# deploy/envoy/templates/ in a source checkout (src/endpoint_picker/envoy_config.py -> repo).
DEFAULT_TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "templates"

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MESSAGE_TIMEOUT = 10.0
DEFAULT_STREAM_IDLE_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_NUM_RETRIES = 2
# Above the EPP's --max-request-headers (100, Envoy's own default): the EPP answers 431 before
# its header mutation could push a request past Envoy's limit (see docs/envoy.md).
DEFAULT_MAX_HEADERS_COUNT = 120
# Routed to the pool besides /v1/completions (whose route the others reuse); the EPP answers
# /v1/models and /health (the gateway's own health: a pod's is never reached) itself.
# Everything else is a 404 at Envoy: a model server's admin API stays shut.
DEFAULT_INFERENCE_PATHS = ("/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health")
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@/-]*")

_PLACEHOLDER = re.compile(r"\$\{([a-z_]+)\}")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


class EnvoyConfigError(ConfigError, ValueError):
    """An input cannot be rendered into a valid configuration (one line, for the CLI)."""


def _duration(seconds: float, name: str) -> str:
    """Seconds as a protobuf JSON duration: ``10s``, ``0.25s``, ``0s``."""
    if seconds < 0:
        raise EnvoyConfigError(f"{name} must not be negative: {seconds}")
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _port(value: int, name: str) -> str:
    if not 0 < value < 65536:
        raise EnvoyConfigError(f"{name} must be a port in 1..65535: {value}")
    return str(value)


def _address(value: str, name: str) -> str:
    """An IP address or a DNS name (validated here so nothing odd lands in the YAML)."""
    if _is_ip(value) or _HOSTNAME.fullmatch(value):
        return value
    raise EnvoyConfigError(f"{name} is not an IP address or host name: {value!r}")


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def parse_endpoint(text: str) -> tuple[str, int]:
    """``10.0.0.5:8000`` or ``[fd00::5]:8000`` -> (ip, port); pool endpoints are IPs."""
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = ascii_int(port_text, 10**19)  # any digits: a port out of range is said as such
    if not sep or number is None or not _is_ip(host):
        raise EnvoyConfigError(f"endpoint must be ip:port: {text!r}")
    _port(number, f"endpoint {text!r} port")
    return host, number


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
    paths = list(dict.fromkeys([*DEFAULT_INFERENCE_PATHS, *extra_paths]))
    lines = []
    for path in paths:
        if not _PATH.fullmatch(path) or "/../" in path or path.endswith("/.."):
            raise EnvoyConfigError(f"inference path must be an absolute URL path: {path!r}")
        if path == "/v1/completions":
            continue
        lines += [f"- match: {{ path: {quote(path)} }}", "  route: *inference_route"]
    return "\n".join(lines)


def quote(value: str) -> str:
    """A YAML double-quoted scalar (for IPv6 addresses and the like)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _file(path: str, name: str) -> str:
    """A file path as Envoy will open it (not read here: it is a path in Envoy's filesystem)."""
    if not path.strip() or any(not c.isprintable() for c in path):
        raise EnvoyConfigError(f"{name} is not a usable file path: {path!r}")
    return f"{{ filename: {quote(path)} }}"


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
            f"      - certificate_chain: {_file(client_cert, 'epp_client_cert')}",
            f"        private_key: {_file(client_key, 'epp_client_key')}",
        ]
    # Without a CA the EPP's certificate (self-signed unless --cert-path gives it one) is not
    # verified: encrypted, not authenticated. With one, the chain and the SNI name are checked.
    if ca is not None:
        lines += [
            "      validation_context:",
            f"        trusted_ca: {_file(ca, 'epp_ca')}",
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
    if variant not in VARIANTS:
        raise EnvoyConfigError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    path = (template_dir or DEFAULT_TEMPLATE_DIR) / f"{variant}.yaml"
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
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    failure_mode_allow: bool = False,
    message_timeout: float = DEFAULT_MESSAGE_TIMEOUT,
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
    upstream_connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    num_retries: int = DEFAULT_NUM_RETRIES,
    inference_paths: Sequence[str] = (),
    max_headers_count: int = DEFAULT_MAX_HEADERS_COUNT,
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
        "listen_address": quote(_address(listen_address, "listen_address")),
        "listen_port": _port(listen_port, "listen_port"),
        "admin_address": quote(_address(admin_address, "admin_address")),
        "admin_port": _port(admin_port, "admin_port"),
        "epp_address": quote(_address(epp_address, "epp_address")),
        "epp_port": _port(epp_port, "epp_port"),
        "epp_cluster_type": "STATIC" if _is_ip(epp_address) else "STRICT_DNS",
        "epp_transport_socket": _transport_socket(
            epp_tls, _address(epp_sni, "epp_sni"), epp_client_cert, epp_client_key, epp_ca
        ),
        "max_request_bytes": str(max_request_bytes),
        "failure_mode_allow": "true" if failure_mode_allow else "false",
        "message_timeout": _duration(message_timeout, "message_timeout"),
        "stream_idle_timeout": _duration(stream_idle_timeout, "stream_idle_timeout"),
        "upstream_connect_timeout": _duration(upstream_connect_timeout, "connect_timeout"),
        "num_retries": str(num_retries),
        "inference_routes": _routes_block(inference_paths),
        "max_headers_count": str(max_headers_count),
        "pool_endpoints": _endpoints_block(endpoints) if variant == "fallback" else "",
        "runtime_layer": _runtime_layer(ext_proc_graceful_close),
    }
    return substitute(template, values)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def build_parser(prog: str = "epp envoy-config") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print an Envoy configuration that puts the Endpoint Picker in front of a "
        "pool of model servers (see docs/envoy.md).",
    )
    add = parser.add_argument
    add("--variant", choices=VARIANTS, default="reference", help="default: %(default)s")
    add("--output", "-o", type=Path, help="write here instead of stdout")
    add("--listen-address", default="0.0.0.0", help="default: %(default)s")
    add("--listen-port", type=int, default=8081, help="default: %(default)s")
    add("--admin-address", default="127.0.0.1", help="default: %(default)s")
    add("--admin-port", type=int, default=19000, help="default: %(default)s")
    add("--epp-address", default="127.0.0.1", help="IP or DNS name; default: %(default)s")
    add("--epp-port", type=int, default=9002, help="the ext_proc port; default: %(default)s")
    add("--epp-tls", type=_bool, default=True, help="TLS to the EPP; default: %(default)s")
    add("--epp-sni", default="localhost", help="default: %(default)s")
    add("--epp-client-cert", metavar="FILE", help="mTLS: Envoy's client certificate (PEM)")
    add("--epp-client-key", metavar="FILE", help="mTLS: its private key (PEM)")
    add("--epp-ca", metavar="FILE", help="verify the EPP's certificate against this CA (PEM)")
    add(
        "--endpoint",
        action="append",
        default=[],
        dest="endpoints",
        metavar="IP:PORT",
        help="a pool endpoint (repeat; the fallback variant needs them)",
    )
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    add(
        "--failure-mode-allow",
        type=_bool,
        default=False,
        help="forward requests when the EPP fails (default false: FailClose)",
    )
    add("--message-timeout", type=float, default=DEFAULT_MESSAGE_TIMEOUT, help="seconds")
    add(
        "--ext-proc-graceful-close",
        action="store_true",
        help="half-close ext_proc streams instead of resetting them (stops a memory leak in "
        "the EPP; experimental in Envoy, see docs/envoy.md)",
    )
    add("--stream-idle-timeout", type=float, default=DEFAULT_STREAM_IDLE_TIMEOUT, help="seconds")
    add("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT, help="seconds")
    add(
        "--num-retries",
        type=int,
        default=DEFAULT_NUM_RETRIES,
        help="fallback variant: attempts after the first",
    )
    add(
        "--inference-path",
        action="append",
        default=[],
        dest="inference_paths",
        metavar="PATH",
        help="also route this path to the pool (repeat; give the EPP --extra-inference-path too)",
    )
    add(
        "--max-headers-count",
        type=int,
        default=DEFAULT_MAX_HEADERS_COUNT,
        help="request headers Envoy accepts (431 past it); default: %(default)s",
    )
    add("--template-dir", type=Path, help=f"default: {DEFAULT_TEMPLATE_DIR}")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "epp envoy-config") -> int:
    """Render one variant to stdout or ``--output``; 0 on success, 2 on a bad input."""
    args = build_parser(prog).parse_args(argv)
    try:
        text = render(
            args.variant,
            listen_address=args.listen_address,
            listen_port=args.listen_port,
            admin_address=args.admin_address,
            admin_port=args.admin_port,
            epp_address=args.epp_address,
            epp_port=args.epp_port,
            epp_tls=args.epp_tls,
            epp_sni=args.epp_sni,
            epp_client_cert=args.epp_client_cert,
            epp_client_key=args.epp_client_key,
            epp_ca=args.epp_ca,
            endpoints=args.endpoints,
            max_request_bytes=args.max_request_bytes,
            failure_mode_allow=args.failure_mode_allow,
            message_timeout=args.message_timeout,
            stream_idle_timeout=args.stream_idle_timeout,
            upstream_connect_timeout=args.connect_timeout,
            num_retries=args.num_retries,
            inference_paths=args.inference_paths,
            max_headers_count=args.max_headers_count,
            ext_proc_graceful_close=args.ext_proc_graceful_close,
            template_dir=args.template_dir,
        )
    except EnvoyConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"{prog}: error: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
