"""``epp envoy-config`` (and ``python -m endpoint_picker.envoy_config``): the flags, and one
variant rendered to stdout or ``--output``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from endpoint_picker.envoy_config import inputs
from endpoint_picker.envoy_config.inputs import EnvoyConfigError
from endpoint_picker.envoy_config.render import render


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
    add("--variant", choices=inputs.VARIANTS, default="reference", help="default: %(default)s")
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
    add("--max-request-bytes", type=int, default=inputs.DEFAULT_MAX_REQUEST_BYTES)
    add(
        "--failure-mode-allow",
        type=_bool,
        default=False,
        help="forward requests when the EPP fails (default false: FailClose)",
    )
    add("--message-timeout", type=float, default=inputs.DEFAULT_MESSAGE_TIMEOUT, help="seconds")
    add(
        "--ext-proc-graceful-close",
        action="store_true",
        help="half-close ext_proc streams instead of resetting them (stops a memory leak in "
        "the EPP; experimental in Envoy, see docs/envoy.md)",
    )
    add(
        "--stream-idle-timeout",
        type=float,
        default=inputs.DEFAULT_STREAM_IDLE_TIMEOUT,
        help="seconds",
    )
    add("--connect-timeout", type=float, default=inputs.DEFAULT_CONNECT_TIMEOUT, help="seconds")
    add(
        "--num-retries",
        type=int,
        default=inputs.DEFAULT_NUM_RETRIES,
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
        default=inputs.DEFAULT_MAX_HEADERS_COUNT,
        help="request headers Envoy accepts (431 past it); default: %(default)s",
    )
    add("--template-dir", type=Path, help=f"default: {inputs.DEFAULT_TEMPLATE_DIR}")
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
