"""Mutual TLS between a real Envoy and the EPP: the rendered client certificate is required."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

from endpoint_picker.app import App
from endpoint_picker.envoy_config import EnvoyConfigError, render
from tests.e2e.harness import Backend, backends, e2e_pool, post, running_envoy
from tests.support.extproc import make_settings, started_app
from tests.support.pki import Pki, make_pki, with_mtls

PAYLOAD = {"model": "m", "prompt": "hello"}


@pytest_asyncio.fixture
async def pool_backends() -> AsyncIterator[list[Backend]]:
    async with backends(("127.0.0.8", "127.0.0.9")) as servers:
        yield servers


@contextlib.asynccontextmanager
async def mtls_epp(tmp_path: Path, pki: Pki, pool_text: str) -> AsyncIterator[App]:
    """The EPP with a CA-signed server certificate, requiring client certificates."""
    async with started_app(with_mtls(make_settings(tmp_path, pool_text), pki, tmp_path)) as app:
        yield app


@pytest.mark.e2e
async def test_envoy_with_the_rendered_client_certificate_routes_over_mtls_and_without_is_refused(
    tmp_path: Path, pool_backends: list[Backend]
) -> None:
    """Envoy rendered with --epp-client-cert/--epp-ca routes a request; without the cert, 500."""
    pki = make_pki()
    client_cert, client_key = pki.client.write(tmp_path / "gateway", "tls")
    ca_file, _ = pki.ca.write(tmp_path / "gateway", "ca")
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session,
        mtls_epp(tmp_path, pki, e2e_pool(pool_backends)) as epp,
    ):
        async with running_envoy(
            tmp_path,
            "reference",
            epp_port=epp.ports.ext_proc,
            epp_client_cert=str(client_cert),
            epp_client_key=str(client_key),
            epp_ca=str(ca_file),
        ) as envoy:
            reply = await post(session, envoy.url, PAYLOAD)
            assert reply.status == 200, (reply.body, envoy.log_tail())
            assert reply.json["served_by"] in {b.hostport for b in pool_backends}
        for backend in pool_backends:
            backend.received.clear()
        async with running_envoy(tmp_path, "reference", epp_port=epp.ports.ext_proc) as envoy:
            reply = await post(session, envoy.url, PAYLOAD)
            # the handshake fails, ext_proc fails closed: nothing reaches a backend
            assert reply.status == 500, (reply.body, envoy.log_tail())
        assert not any(b.received for b in pool_backends)


def test_the_renderer_puts_the_client_certificate_and_ca_in_the_upstream_tls_context() -> None:
    """--epp-client-cert/--epp-client-key/--epp-ca land in the EPP cluster's UpstreamTlsContext."""
    config = yaml.safe_load(
        render(
            "reference",
            epp_sni="epp.ns.svc",
            epp_client_cert="/etc/envoy/epp-client/tls.crt",
            epp_client_key="/etc/envoy/epp-client/tls.key",
            epp_ca="/etc/envoy/epp-client/ca.crt",
        )
    )
    (epp,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "endpoint_picker"]
    context = epp["transport_socket"]["typed_config"]["common_tls_context"]
    assert context["tls_certificates"] == [
        {
            "certificate_chain": {"filename": "/etc/envoy/epp-client/tls.crt"},
            "private_key": {"filename": "/etc/envoy/epp-client/tls.key"},
        }
    ]
    assert context["validation_context"] == {
        "trusted_ca": {"filename": "/etc/envoy/epp-client/ca.crt"},
        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "epp.ns.svc"}}],
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epp_client_cert": "/c.crt"}, "go together"),
        ({"epp_client_cert": "/c.crt", "epp_client_key": "/c.key", "epp_tls": False}, "need"),
        ({"epp_ca": "/ca.crt", "epp_tls": False}, "need --epp-tls"),
        ({"epp_client_cert": "/c\n.crt", "epp_client_key": "/c.key"}, "not a usable file"),
    ],
)
def test_inconsistent_mtls_render_options_fail_clearly(
    options: dict[str, object], message: str
) -> None:
    """A cert without its key, mTLS without TLS or a path with a newline: EnvoyConfigError."""
    with pytest.raises(EnvoyConfigError, match=message):
        render("reference", **options)  # type: ignore[arg-type]
