"""Mutual TLS on the ext_proc port (--client-ca-file), with real gRPC TLS clients."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from tests.support.extproc import (
    Client,
    completion,
    lb_metadata,
    make_settings,
    started_app,
)
from tests.support.pki import KeyPair, Pki, make_pki, with_mtls
from tests.support.pool import ONE_POD

from endpoint_picker.app import App
from endpoint_picker.errors import ConfigError

# each test runs on both gRPC stacks of the ext_proc port (tests/integration/conftest.py)
pytestmark = pytest.mark.usefixtures("ext_proc_server")

REQUEST = completion()


@pytest.fixture(scope="module")
def pki() -> Pki:
    return make_pki()


@pytest_asyncio.fixture
async def mtls_app(tmp_path: Path, pki: Pki) -> AsyncIterator[App]:
    async with started_app(
        with_mtls(make_settings(tmp_path, ONE_POD), pki, tmp_path), drain_timeout=0.2
    ) as app:
        yield app


def channel(app: App, ca: bytes, client: KeyPair | None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    return grpc.aio.secure_channel(
        f"127.0.0.1:{app.ports.ext_proc}",
        credentials,
        options=[("grpc.ssl_target_name_override", "localhost")],
    )


async def test_a_client_with_a_certificate_from_the_ca_is_routed(mtls_app: App, pki: Pki) -> None:
    """With the gateway's certificate (signed by --client-ca-file's CA) a request is routed."""
    async with channel(mtls_app, pki.ca.cert, pki.client) as ch:
        out = await Client(ch).exchange(REQUEST)
    assert lb_metadata(out[0]) == "127.0.0.2:8000"


async def test_a_client_without_a_certificate_is_refused(mtls_app: App, pki: Pki) -> None:
    """Without a client certificate the handshake fails: the stream never reaches the EPP."""
    async with channel(mtls_app, pki.ca.cert, None) as ch:
        assert await Client(ch).exchange_error(REQUEST) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_certificate_from_another_ca_is_refused(mtls_app: App, pki: Pki) -> None:
    """A certificate the configured CA did not sign is refused like no certificate."""
    stranger = make_pki("stranger").client
    async with channel(mtls_app, pki.ca.cert, stranger) as ch:
        assert await Client(ch).exchange_error(REQUEST) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), (b"not a certificate\n", "holds no PEM certificate")],
)
async def test_a_bad_client_ca_file_is_a_config_error(
    tmp_path: Path, pki: Pki, content: bytes | None, message: str
) -> None:
    """A missing or non-PEM --client-ca-file stops the start with a ConfigError naming the flag."""
    ca_file = tmp_path / "ca.crt"
    if content is not None:
        ca_file.write_bytes(content)
    settings = make_settings(tmp_path, ONE_POD)
    server = replace(settings.server, secure_serving=True, client_ca_file=ca_file)
    app = App(replace(settings, server=server))
    try:
        with pytest.raises(ConfigError, match=message) as caught:
            await app.start()
        assert caught.value.path == "--client-ca-file"
    finally:
        await app.stop(drain_timeout=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--secure-serving", "false"], "--client-ca-file needs --secure-serving true"),
        ([], "holds no PEM certificate"),
    ],
)
def test_client_ca_flag_errors_exit_2(tmp_path: Path, flags: list[str], message: str) -> None:
    """`epp serve --client-ca-file` with plaintext serving or a non-PEM file: exit 2, one error."""
    (tmp_path / "pool.yaml").write_text(ONE_POD)
    (tmp_path / "ca.crt").write_text("junk\n")
    args = [
        "--pool-file",
        str(tmp_path / "pool.yaml"),
        "--client-ca-file",
        str(tmp_path / "ca.crt"),
    ]
    ports = ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "endpoint_picker", "serve", *args, *ports, *flags],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    # (the app's own "draining"/"stopped" log lines may precede it)
    assert message in result.stderr.strip().splitlines()[-1]
