"""Who may read the metrics port, end to end: the EPP as `epp serve` builds it, over real HTTP.

Kubernetes mode runs the real client against the API-server double, which reviews the tokens;
the static-token mode and TLS / mutual TLS use real files and real certificates.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from structlog.testing import capture_logs
from tests.support.extproc import make_settings, running_app, started_app
from tests.support.kubeapi import serve_kube_api
from tests.support.metrics_auth import (
    DATA_PATHS,
    PROMETHEUS,
    READERS,
    kubernetes_epp,
    kubernetes_settings,
)
from tests.support.pki import make_pki
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import MetricsAuth, MetricsEndpointSettings, Settings

pytestmark = pytest.mark.timeout(30)


async def get(
    session: aiohttp.ClientSession, url: str, token: str | None = None
) -> tuple[int, Any]:
    """GET with an optional bearer token: the status and the JSON body (or the text)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.get(url, headers=headers) as reply:
        if reply.content_type == "application/json":
            return reply.status, await reply.json()
        return reply.status, await reply.text()


async def statuses(
    session: aiohttp.ClientSession, base: str, paths: Sequence[str], token: str | None
) -> dict[str, int]:
    return {path: (await get(session, base + path, token))[0] for path in paths}


async def test_kubernetes_tokens_decide_401_403_and_200_and_the_probes_stay_open(
    tmp_path: Path,
) -> None:
    """With the Kubernetes source auth is on by default: no token is 401 (with a JSON body
    and WWW-Authenticate), a token the API rejects 401, a valid token without the permission
    403, a permitted one 200 for /metrics and the status page's JSON (each path reviewed on
    its own: a grant of /metrics alone does not open /api/status); /healthz and /readyz and
    the page's own files answer without a token."""
    async with kubernetes_epp(tmp_path) as (api, base), aiohttp.ClientSession() as session:
        api.add_token("t-prometheus", PROMETHEUS, (READERS,))
        api.add_token("t-nobody", "system:serviceaccount:default:nobody")
        api.add_token("t-metrics-only", "metrics-only")
        api.grant(READERS, *DATA_PATHS)
        api.grant("metrics-only", "/metrics")

        async with session.get(base + "/metrics") as reply:
            assert reply.status == 401
            assert reply.headers["WWW-Authenticate"].startswith("Bearer")
            body = await reply.json()
        assert body["error"]["code"] == 401
        assert body["error"]["type"] == "Unauthorized"
        assert api.reviews == 0  # no token: refused without asking the API
        assert await statuses(session, base, (*DATA_PATHS, "/nope"), None) == {
            "/metrics": 401,
            "/api/status": 401,
            "/nope": 401,
        }
        assert await statuses(session, base, DATA_PATHS, "forged") == {
            "/metrics": 401,
            "/api/status": 401,
        }
        status, body = await get(session, base + "/metrics", "t-nobody")
        assert status == 403
        assert body["error"]["type"] == "Forbidden"
        assert "may not get /metrics" in body["error"]["message"]
        assert await statuses(session, base, DATA_PATHS, "t-metrics-only") == {
            "/metrics": 200,
            "/api/status": 403,
        }
        status, text = await get(session, base + "/metrics", "t-prometheus")
        assert status == 200
        assert "inference_pool_ready_pods" in text
        status, page = await get(session, base + "/api/status", "t-prometheus")
        assert (status, page["pool"]["name"]) == (200, "pool")
        reviews = api.reviews
        assert await statuses(session, base, ("/healthz", "/readyz", "/"), None) == {
            "/healthz": 200,
            "/readyz": 200,
            "/": 200,
        }
        assert (await get(session, base + "/static/status.js"))[0] == 200
        assert api.reviews == reviews  # open paths ask nothing


async def test_a_burst_of_scrapes_with_one_token_makes_at_most_a_few_api_calls(
    tmp_path: Path,
) -> None:
    """100 concurrent scrapes with one token (reviews slowed so that they overlap) and 100 more
    after them: one TokenReview and one SubjectAccessReview in all; every scrape gets 200."""
    async with kubernetes_epp(tmp_path) as (api, base), aiohttp.ClientSession() as session:
        api.add_token("t-prometheus", PROMETHEUS, (READERS,))
        api.grant(READERS, "/metrics")
        api.review_delay = 0.1
        scrape = (get(session, base + "/metrics", "t-prometheus") for _ in range(100))
        first = await asyncio.gather(*scrape)
        second = [await get(session, base + "/metrics", "t-prometheus") for _ in range(100)]
    assert {status for status, _ in [*first, *second]} == {200}
    assert [r["kind"] for r in api.reviewed] == ["TokenReview", "SubjectAccessReview"]


async def test_api_server_down_gives_503_logged_once_and_recovers(tmp_path: Path) -> None:
    """Reviews cut mid-connection: every request gets 503 with a JSON body (fail closed, the
    probes still answer), the outage is logged once for all of them; when the API answers
    again the same token gets 200 at its next request (failures were not cached)."""
    async with kubernetes_epp(tmp_path) as (api, base), aiohttp.ClientSession() as session:
        api.add_token("t-prometheus", PROMETHEUS, (READERS,))
        api.grant(READERS, "/metrics")
        with capture_logs() as logs:
            api.reviews_down = True
            for _ in range(5):
                status, body = await get(session, base + "/metrics", "t-prometheus")
                assert status == 503
                assert body["error"]["type"] == "ServiceUnavailable"
            assert (await get(session, base + "/healthz"))[0] == 200  # probes unaffected
            api.reviews_down = False
            status, _ = await get(session, base + "/metrics", "t-prometheus")
            assert status == 200
    outage = [e for e in logs if e["log_level"] == "warning" and "503" in e["event"]]
    assert len(outage) == 1, logs
    assert "unreachable" in outage[0]["error"]
    assert any(e["event"].endswith("again") for e in logs)


async def test_metrics_endpoint_auth_false_opens_the_port(tmp_path: Path) -> None:
    """--metrics-endpoint-auth=false with the Kubernetes source: the reference's opt-out;
    /metrics answers without a token and nothing is reviewed."""
    async with serve_kube_api("127.0.8.9") as api:
        api.put(pool(port=8000))
        settings = kubernetes_settings(api, tmp_path, "--metrics-endpoint-auth=false")
        assert settings.server.metrics_endpoint.auth is MetricsAuth.OFF
        async with (
            started_app(settings, drain_timeout=0) as app,
            aiohttp.ClientSession() as session,
        ):
            url = f"http://127.0.0.1:{app.ports.metrics}/metrics"
            assert (await get(session, url))[0] == 200
    assert api.reviews == 0


# -- static tokens and TLS, with a pool file ------------------------------------------------------


def file_settings(tmp_path: Path, **endpoint: Any) -> Settings:
    settings = make_settings(
        tmp_path, pool_yaml(pool(port=8000), model("base"), pod("p0", "127.0.8.2"))
    )
    metrics_endpoint = MetricsEndpointSettings(**endpoint)
    return replace(settings, server=replace(settings.server, metrics_endpoint=metrics_endpoint))


def token_settings(tmp_path: Path, token: str, **endpoint: Any) -> Settings:
    """``file_settings`` with --metrics-token-file holding ``token`` (at tmp_path/metrics-token)."""
    tokens = tmp_path / "metrics-token"
    tokens.write_text(f"{token}\n")
    return file_settings(tmp_path, auth=MetricsAuth.TOKEN_FILE, token_file=tokens, **endpoint)


async def test_static_token_file_guards_the_port_and_follows_rotation(tmp_path: Path) -> None:
    """--metrics-token-file: the listed token reads /metrics and /api/status, others get 401;
    after the file is rewritten the new token works and the old one is refused at once."""
    settings = token_settings(tmp_path, "s3cret-one")
    async with running_app(settings) as (app, _), aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{app.ports.metrics}"
        assert await statuses(session, base, DATA_PATHS, "s3cret-one") == {
            "/metrics": 200,
            "/api/status": 200,
        }
        assert await statuses(session, base, DATA_PATHS, None) == {
            "/metrics": 401,
            "/api/status": 401,
        }
        assert (await get(session, base + "/metrics", "s3cret-on"))[0] == 401
        (tmp_path / "metrics-token").write_text("s3cret-two-rotated\n")
        assert (await get(session, base + "/metrics", "s3cret-two-rotated"))[0] == 200
        assert (await get(session, base + "/metrics", "s3cret-one"))[0] == 401
        assert (await get(session, base + "/readyz"))[0] == 200


async def test_a_missing_token_file_fails_the_start(tmp_path: Path) -> None:
    """A token file that does not exist at start is a configuration error (exit 2)."""
    settings = file_settings(tmp_path, auth=MetricsAuth.TOKEN_FILE, token_file=tmp_path / "missing")
    app = App(settings)
    with pytest.raises(ConfigError, match="--metrics-token-file"):
        await app.start()


def client_context(ca: bytes, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.decode())
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


async def peer_serial(port: int, context: ssl.SSLContext) -> int:
    """A new TLS connection's server certificate serial number."""
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def test_tls_serves_the_certificate_and_reloads_it_when_it_changes(tmp_path: Path) -> None:
    """--metrics-cert-dir: HTTPS only, with tls.crt; once tls.crt and tls.key are replaced by
    another pair, new connections get the new certificate without a restart, and a broken pair
    written meanwhile leaves the last good one serving."""
    first, second = make_pki("first"), make_pki("second")
    cert_dir = first.write_server_dir(tmp_path / "certs")
    settings = token_settings(tmp_path, "tok", cert_dir=cert_dir, cert_reload_interval=0.05)
    async with running_app(settings) as (app, _):
        port = app.ports.metrics
        trust_first = client_context(first.ca.cert)
        trust_both = client_context(first.ca.cert + second.ca.cert)
        connector = aiohttp.TCPConnector(ssl=trust_first)
        async with aiohttp.ClientSession(connector=connector) as session:
            status, text = await get(session, f"https://localhost:{port}/metrics", "tok")
            assert status == 200
            assert "inference_model_request_total" in text
            assert (await get(session, f"https://localhost:{port}/metrics"))[0] == 401
        async with aiohttp.ClientSession() as session:  # plaintext is not served
            with pytest.raises(aiohttp.ClientError):
                await get(session, f"http://127.0.0.1:{port}/readyz")
        serial = x509.load_pem_x509_certificate(first.server.cert).serial_number
        assert await peer_serial(port, trust_first) == serial

        (cert_dir / "tls.crt").write_bytes(second.server.cert)  # half a rotation
        await asyncio.sleep(0.3)
        assert await peer_serial(port, trust_first) == serial  # the old pair still serves

        (cert_dir / "tls.key").write_bytes(second.server.key)
        new_serial = x509.load_pem_x509_certificate(second.server.cert).serial_number
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while await peer_serial(port, trust_both) != new_serial:
            assert loop.time() < deadline, "the new certificate was not served"
            await asyncio.sleep(0.05)


async def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(
    tmp_path: Path,
) -> None:
    """--metrics-client-ca-file: a client certificate signed by that CA gets through (then the
    token is still checked); no client certificate, or one from another CA, fails the handshake."""
    pki, stranger = make_pki("metrics"), make_pki("stranger")
    ca_file, _ = pki.ca.write(tmp_path / "ca", "ca")
    cert_dir = pki.write_server_dir(tmp_path / "certs")
    settings = token_settings(tmp_path, "tok", cert_dir=cert_dir, client_ca_file=ca_file)
    async with running_app(settings) as (app, _):
        url = f"https://localhost:{app.ports.metrics}/metrics"
        own = pki.client.write(tmp_path / "client", "client")
        foreign = stranger.client.write(tmp_path / "stranger", "client")
        contexts = {
            "own": client_context(pki.ca.cert, own),
            "none": client_context(pki.ca.cert),
            "foreign": client_context(pki.ca.cert, foreign),
        }
        outcomes: dict[str, object] = {}
        for name, context in contexts.items():
            connector = aiohttp.TCPConnector(ssl=context)
            async with aiohttp.ClientSession(connector=connector) as session:
                try:
                    outcomes[name] = (await get(session, url, "tok"))[0]
                except aiohttp.ClientError:
                    outcomes[name] = "refused"
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=contexts["own"])
        ) as session:
            assert (await get(session, url))[0] == 401  # mTLS does not replace the token
    assert outcomes == {"own": 200, "none": "refused", "foreign": "refused"}


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ({"cert_dir": "missing"}, "--metrics-cert-dir"),
        ({"cert_dir": "certs", "client_ca_file": "not-pem"}, "--metrics-client-ca-file"),
        ({"client_ca_file": "ca.crt"}, "needs --metrics-cert-dir"),
    ],
)
async def test_bad_tls_files_fail_the_start(
    tmp_path: Path, endpoint: dict[str, str], message: str
) -> None:
    """A missing certificate folder, a CA file that is not PEM, or a CA without a certificate
    stop the EPP at start with a configuration error, never a plaintext port."""
    pki = make_pki()
    pki.write_server_dir(tmp_path / "certs")
    pki.ca.write(tmp_path, "ca")
    (tmp_path / "not-pem").write_text("hello")
    paths = {key: tmp_path / value for key, value in endpoint.items()}
    app = App(file_settings(tmp_path, **paths))
    with pytest.raises(ConfigError, match=message):
        await app.start()
