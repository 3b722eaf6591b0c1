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
the placeholder's column. This package only renders text: it imports no gRPC and no protos.

The parts, each importing only those after it: ``cli`` (the flags, ``main``), ``render`` (the
templates and their blocks), ``inputs`` (each input checked and spelled as YAML).
"""

from __future__ import annotations

from endpoint_picker.envoy_config.cli import build_parser, main
from endpoint_picker.envoy_config.inputs import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_INFERENCE_PATHS,
    DEFAULT_MAX_HEADERS_COUNT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MESSAGE_TIMEOUT,
    DEFAULT_NUM_RETRIES,
    DEFAULT_STREAM_IDLE_TIMEOUT,
    DEFAULT_TEMPLATE_DIR,
    VARIANTS,
    EnvoyConfigError,
    parse_endpoint,
    quote,
)
from endpoint_picker.envoy_config.render import load_template, render, substitute

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_INFERENCE_PATHS",
    "DEFAULT_MAX_HEADERS_COUNT",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MESSAGE_TIMEOUT",
    "DEFAULT_NUM_RETRIES",
    "DEFAULT_STREAM_IDLE_TIMEOUT",
    "DEFAULT_TEMPLATE_DIR",
    "VARIANTS",
    "EnvoyConfigError",
    "build_parser",
    "load_template",
    "main",
    "parse_endpoint",
    "quote",
    "render",
    "substitute",
]
