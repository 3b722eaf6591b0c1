"""Who may read the metrics port: each setting's access, or the error that refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from endpoint_picker.app.metrics_port import MetricsAccess, build_access
from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import MetricsAuth, MetricsEndpointSettings
from endpoint_picker.status import CachedReviews, StaticTokens
from endpoint_picker.status.auth import AccessDecision


async def _review(token: str, path: str) -> AccessDecision:
    raise AssertionError("never asked in these tests")


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        (
            MetricsEndpointSettings(client_ca_file=Path("ca.pem")),
            "--metrics-client-ca-file needs --metrics-cert-dir",
        ),
        (
            MetricsEndpointSettings(auth=MetricsAuth.TOKEN_FILE),
            "token-file auth needs --metrics-token-file",
        ),
        (
            MetricsEndpointSettings(auth=MetricsAuth.KUBERNETES),
            "checks tokens with the Kubernetes API",
        ),
    ],
)
def test_an_access_that_cannot_hold_is_refused(
    endpoint: MetricsEndpointSettings, message: str
) -> None:
    """mTLS without a certificate, token files without a file, Kubernetes reviews without the
    Kubernetes source: each a ``ConfigError`` that names the flag, never an open port."""
    with pytest.raises(ConfigError, match=message):
        build_access(endpoint, None, lambda: 0.0)


async def test_each_auth_gets_its_authorizer(tmp_path: Path) -> None:
    """Off: anyone; a token file: its tokens; Kubernetes: cached reviews, closed with the port."""
    assert build_access(MetricsEndpointSettings(), None, lambda: 0.0) == MetricsAccess()
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    by_file = build_access(
        MetricsEndpointSettings(auth=MetricsAuth.TOKEN_FILE, token_file=tokens), None, lambda: 0.0
    )
    assert isinstance(by_file.auth, StaticTokens)
    assert by_file.reviews is None
    by_api = build_access(
        MetricsEndpointSettings(auth=MetricsAuth.KUBERNETES), _review, lambda: 0.0
    )
    assert isinstance(by_api.auth, CachedReviews)
    assert by_api.reviews is by_api.auth
    await by_api.reviews.close()
