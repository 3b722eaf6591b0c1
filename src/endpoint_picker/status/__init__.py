"""The metrics port: the EPP's Prometheus metrics, HTTP probes and the live status page.

``MetricsServer`` (``server``) serves ``/metrics``, ``/healthz``, ``/readyz``, the page (``/``,
``static/``) and its JSON (``/api/status``), which ``StatusView`` (``view``) builds on demand
from the parts the composition root passes in; ``DecisionLog`` (``decisions``) keeps the last
routing decisions and refusals. Who may read the port is an ``Authorizer`` (``auth``:
``StaticTokens`` for ``--metrics-token-file``, ``CachedReviews`` around the Kubernetes
reviewer); ``ReloadingTls`` (``tls``) is its HTTPS certificate, reloaded on change.

A layer of its own above the request path: it reads the datastore, the scheduler's records and
flow control, and nothing on the request path imports it (the root hands the scheduler and the
ext_proc stream its two recording methods).
"""

from endpoint_picker.status.auth import Authorizer, CachedReviews, StaticTokens
from endpoint_picker.status.decisions import DecisionLog
from endpoint_picker.status.server import MetricsServer
from endpoint_picker.status.tls import ReloadingTls
from endpoint_picker.status.view import KVEventsRows, PredictorRows, StatusView

__all__ = [
    "Authorizer",
    "CachedReviews",
    "DecisionLog",
    "KVEventsRows",
    "MetricsServer",
    "PredictorRows",
    "ReloadingTls",
    "StaticTokens",
    "StatusView",
]
