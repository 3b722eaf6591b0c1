"""The metrics port (``/metrics``, probes, the status page): who may read it, its TLS, the view
it serves, and the server, started and stopped as one part. Served by one EPP or by a workers'
parent (for all its workers); a worker has none."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import MetricsAuth, MetricsEndpointSettings, ServerSettings
from endpoint_picker.status import (
    Authorizer,
    CachedReviews,
    MetricsServer,
    ReloadingTls,
    StaticTokens,
)
from endpoint_picker.status.auth import Review
from endpoint_picker.status.view import StatusView
from endpoint_picker.telemetry.tasks import NamedTask
from endpoint_picker.types import format_hostport


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    auth: Authorizer | None = None  # None: anyone who reaches the port
    tls: ReloadingTls | None = None
    reviews: CachedReviews | None = None  # tokens checked with the Kubernetes API


def build_access(
    endpoint: MetricsEndpointSettings,
    review: Review | None,  # the Kubernetes source's TokenReview, with that source
    clock: Callable[[], float],
) -> MetricsAccess:
    """Who may read the metrics port, and its TLS; ``ConfigError`` for a bad file."""
    tls = None
    if endpoint.cert_dir is not None:
        tls = ReloadingTls(
            endpoint.cert_dir,
            endpoint.client_ca_file,
            reload_interval=endpoint.cert_reload_interval,
        )
    elif endpoint.client_ca_file is not None:  # never plaintext when mTLS was asked for
        raise ConfigError("--metrics-client-ca-file needs --metrics-cert-dir")
    if endpoint.auth is MetricsAuth.TOKEN_FILE:
        if endpoint.token_file is None:
            raise ConfigError("token-file auth needs --metrics-token-file")
        tokens = StaticTokens(endpoint.token_file)
        tokens.load()
        return MetricsAccess(tokens, tls)
    if endpoint.auth is MetricsAuth.KUBERNETES:
        if review is None:
            raise ConfigError(
                "--metrics-endpoint-auth checks tokens with the Kubernetes API: use the "
                "Kubernetes source (--pool-name without --pool-file) or --metrics-token-file"
            )
        reviews = CachedReviews(
            review,
            allow_ttl=endpoint.allow_ttl,
            deny_ttl=endpoint.deny_ttl,
            max_entries=endpoint.cache_entries,
            max_concurrent=endpoint.max_concurrent_reviews,
            clock=clock,
        )
        return MetricsAccess(reviews, tls, reviews)
    return MetricsAccess(None, tls)


class MetricsPort:
    """The metrics port's server, once started, and the access it was given."""

    def __init__(self) -> None:
        self.access = MetricsAccess()
        self._server: MetricsServer | None = None

    def tasks(self) -> list[NamedTask]:
        tls = self.access.tls
        return [] if tls is None else [("metrics-tls-reload", tls.watch())]

    async def start(
        self,
        server_settings: ServerSettings,
        view: StatusView,
        render: Callable[[], bytes],
        refresh: Callable[[], Awaitable[None]] | None = None,  # a parent asks its workers
    ) -> int:
        tls = self.access.tls
        self._server = MetricsServer(
            render,
            view,
            auth=self.access.auth,
            tls=tls.context if tls is not None else None,
            refresh=refresh,
        )
        host, port = server_settings.bind_address, server_settings.metrics_port
        try:
            return await self._server.start(host, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {format_hostport(host, port)}: {exc.strerror}"
            ) from exc

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None
        if self.access.reviews is not None:
            await self.access.reviews.close()
