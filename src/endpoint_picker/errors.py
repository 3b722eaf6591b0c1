"""The exception tree of endpoint-picker.

Every error carries a code; the edge (``extproc``, ``cli``) maps codes to HTTP statuses,
gRPC statuses or exit codes, nothing below it does::

    EppError
    ├── ConfigError                 bad flags, pool file or scheduler config (exit 2)
    │   └── EnvoyConfigError        (envoy_config) what `epp envoy-config` cannot render (exit 2;
    │                               still a ValueError too, for callers of ``render``)
    ├── ChannelClosed               (workers/) a worker channel's other end is gone or unreadable
    ├── BenchError                  (bench/) an `epp bench` run cannot go on (exit 2)
    ├── MetricsParseError           (metrics/) a /metrics page lacks what the engine needs
    ├── ScrapeError                 (metrics/) one scrape failed: timeout, status, size
    ├── KVEventsError               (kvevents/) a KV-cache event message that does not decode
    ├── AccessReviewError           the metrics port cannot check a token now (503)
    └── RequestError                one request cannot be routed (an HTTP status)
        ├── BadRequestError         400: malformed JSON, missing fields
        ├── ModelNotFoundError      404: no InferenceModel serves the model
        ├── PathNotFoundError       404: not an inference API the EPP routes
        ├── PayloadTooLargeError    413: a body over --max-request-body-size
        ├── TooManyRequestsError    429: a sheddable request to a saturated pool
        ├── HeadersTooLargeError    431: no room left for the EPP's own headers
        ├── ServiceUnavailableError 503: no eligible ready endpoint
        └── InternalError           500: unsupported processing mode, bugs
"""

from __future__ import annotations

import hashlib
from enum import Enum

CLIP_CHARS = 200  # a client-supplied value quoted in an error body or a log line


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked as cut: clients choose these values, and a
    7 MB model name must not come back in the error body or flood the log."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[cut: {len(text)} characters in all]"


def kept(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` as the EPP may keep it past the request (a decision, a label, a key): whole up
    to ``limit`` characters; longer, cut as ``clip`` does and marked with a digest of the whole,
    so that two long values stay two keys and one value always maps to the same key. One
    helper for every client string the EPP retains: nothing a client sends is kept whole."""
    if len(text) <= limit:
        return text
    digest = hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=8).hexdigest()
    return f"{text[:limit]}...[cut: {len(text)} characters in all, {digest}]"


def shown(text: str) -> str:
    """``text`` with every character that is not printable escaped as ``\\uXXXX`` (controls,
    bidi overrides and isolates, zero-width and other format characters, line separators,
    unassigned code points) and ``\\`` doubled, so that a page or a log line shows what was
    sent, in the order it was sent: a right-to-left override cannot reorder what follows it."""
    if text.isprintable() and "\\" not in text:  # the common case, in C
        return text
    return text.translate(_Escapes())


class _Escapes(dict[int, str]):
    """``str.translate``'s table for ``shown``, filled as characters are met."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        if char == "\\":
            escaped = "\\\\"
        elif char.isprintable():
            escaped = char
        elif code <= 0xFFFF:
            escaped = f"\\u{code:04x}"
        else:
            escaped = f"\\U{code:08x}"
        self[code] = escaped
        return escaped


class ErrorCode(Enum):
    """The error kinds, with the HTTP status and the OpenAI-style ``type`` of each."""

    BAD_REQUEST = (400, "BadRequest")
    NOT_FOUND = (404, "NotFound")
    PAYLOAD_TOO_LARGE = (413, "PayloadTooLarge")
    RESOURCE_EXHAUSTED = (429, "ResourceExhausted")
    HEADERS_TOO_LARGE = (431, "RequestHeaderFieldsTooLarge")
    SERVICE_UNAVAILABLE = (503, "ServiceUnavailable")
    INTERNAL = (500, "Internal")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def type_name(self) -> str:
        return self.value[1]


class EppError(Exception):
    """The root of every error this package raises on purpose."""


class ConfigError(EppError):
    """A configuration input (flag, pool file, scheduler config) is invalid.

    ``path`` names the field at fault: ``document 2 (InferenceModel "chat"): spec.criticality``.
    """

    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class KVEventsError(EppError):
    """A vLLM KV-cache event message (a frame, a batch, an event) that does not decode: it is
    logged and counted, the subscriber goes on (the view of that endpoint is then rebuilt)."""


class AccessReviewError(EppError):
    """A token to the metrics port cannot be checked now: the Kubernetes API is unreachable or
    refuses the review, or the static token file is missing or empty. The port answers 503
    (fail closed); nothing is cached, so the next request asks again."""


class RequestError(EppError):
    """One request cannot be routed; ``code`` says how the client is answered."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        self.message = message
        # what the request asked for and was sent as, once known (for the error metrics)
        self.model = ""
        self.target_model = ""
        super().__init__(message)


class BadRequestError(RequestError):
    code = ErrorCode.BAD_REQUEST


class ModelNotFoundError(RequestError):
    code = ErrorCode.NOT_FOUND


class PathNotFoundError(RequestError):
    code = ErrorCode.NOT_FOUND


class PayloadTooLargeError(RequestError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class TooManyRequestsError(RequestError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class HeadersTooLargeError(RequestError):
    code = ErrorCode.HEADERS_TOO_LARGE


class ServiceUnavailableError(RequestError):
    code = ErrorCode.SERVICE_UNAVAILABLE


class InternalError(RequestError):
    code = ErrorCode.INTERNAL
