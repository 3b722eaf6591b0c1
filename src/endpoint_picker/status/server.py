"""The metrics port's HTTP server (aiohttp, on the event loop).

``GET /metrics``     the EPP's own Prometheus metrics
``GET /healthz``     200 "ok" when ready (with a note when a source is degraded), else 503
``GET /readyz``      200 when ready (the gRPC health service's readiness), else 503
``GET /``            the status page: one static HTML file with its script and style sheet
                     (``static/``, shipped as package data), no build step and no CDN
``GET /api/status``  what the page shows, as JSON (``StatusView``; docs/status-page.md has the
                     schema)

With an ``Authorizer`` (``auth``) every request needs ``Authorization: Bearer <token>``, except
the probes and the page's own files (``/``, ``/static/...``: the same packaged bytes in every
install, no data; a browser cannot put a header on a navigation, so the page's script sends the
token on its fetches of ``/api/status``). No token or a bad one: 401; a token without the
permission: 403; the authorizer cannot tell now: 503. Each with a short JSON body, checked
before any handler runs, so an unknown path answers 401 too. With an
``ssl.SSLContext`` (``tls``) the port speaks HTTPS only.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from importlib import resources

import orjson
from aiohttp import web

from endpoint_picker.errors import AccessReviewError
from endpoint_picker.status.auth import Authorizer
from endpoint_picker.status.view import StatusView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The page loads nothing but its own files and its own JSON.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_ASSETS = {
    "": ("index.html", "text/html"),
    "status.js": ("status.js", "text/javascript"),
    "status.css": ("status.css", "text/css"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}


# Open with auth on: the probes (kubelet sends no token) and the page's own packaged files.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/"})
OPEN_PREFIX = "/static/"
_REFUSALS = {401: "Unauthorized", 403: "Forbidden", 503: "ServiceUnavailable"}


def _load_assets() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("endpoint_picker.status") / "static"
    return {path: ((folder / name).read_bytes(), kind) for path, (name, kind) in _ASSETS.items()}


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (the scheme in any case), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _refusal(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": _REFUSALS.get(status, "Error"), "code": status}}
    headers = {"Cache-Control": "no-store"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="endpoint-picker"'
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


class MetricsServer:
    """Serves the metrics port; ``start`` binds it and returns the port (the real one for 0)."""

    def __init__(
        self,
        render_metrics: Callable[[], bytes],
        view: StatusView,
        *,
        auth: Authorizer | None = None,
        tls: ssl.SSLContext | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._render_metrics = render_metrics
        # awaited before /metrics and /api/status: a parent collects its workers' parts here
        self._refresh = refresh
        self._view = view
        self._auth = auth
        self._tls = tls
        self._assets = _load_assets()
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._guard] if self._auth is not None else [])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/", self._asset)
        app.router.add_get("/static/{name}", self._asset)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; raises ``OSError`` when the port cannot be bound."""
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=self._tls).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        addresses = runner.addresses  # the real port when 0 was asked for (tests)
        return int(addresses[0][1]) if addresses else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Only with an authorizer: every path but the open ones needs an allowed token."""
        path = request.path
        if self._auth is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            return _refusal(401, "this port needs Authorization: Bearer <token>")
        try:
            decision = await self._auth.authorize(token, path)
        except AccessReviewError:  # logged by the authorizer, once per change
            return _refusal(503, "the token cannot be checked now; try again later")
        if not decision.allowed:
            return _refusal(decision.status, decision.reason or "not allowed")
        return await handler(request)

    async def _metrics(self, _: web.Request) -> web.Response:
        if self._refresh is not None:
            await self._refresh()
        return web.Response(
            body=self._render_metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def _healthz(self, _: web.Request) -> web.Response:
        health = self._view.health
        if not health.ready():
            return web.Response(status=503, text="not ready")
        note = health.note()  # still ready: the last good state serves
        return web.Response(text=f"ok ({note})" if note else "ok")

    async def _readyz(self, _: web.Request) -> web.Response:
        ready = self._view.health.ready()
        return web.Response(status=200 if ready else 503, text="ready" if ready else "not ready")

    async def _status(self, _: web.Request) -> web.Response:
        if self._refresh is not None:
            await self._refresh()
        return web.Response(
            body=orjson.dumps(await self._view.snapshot_in_steps()),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def _asset(self, request: web.Request) -> web.Response:
        asset = self._assets.get(request.match_info.get("name", ""))  # "/" has no name
        if asset is None:
            raise web.HTTPNotFound()
        body, kind = asset
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=_PAGE_HEADERS)
