"""Token reviews for the metrics port: the real client against the API-server double."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support.kubeapi import FakeKubeApi, serve_kube_api, write_kubeconfig

from endpoint_picker.datastore.sources.kubernetes import KubernetesAccessReviewer, build_client
from endpoint_picker.errors import AccessReviewError
from endpoint_picker.settings import KubernetesSettings

pytestmark = pytest.mark.timeout(20)


@contextlib.asynccontextmanager
async def reviewer(
    tmp_path: Path, review_timeout: float = 2.0
) -> AsyncIterator[tuple[FakeKubeApi, KubernetesAccessReviewer]]:
    async with serve_kube_api() as api:
        settings = dataclasses.replace(
            KubernetesSettings(), kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url)
        )
        client = build_client(settings)
        try:
            yield api, KubernetesAccessReviewer(client, review_timeout)
        finally:
            await client.close()


async def test_allowed_token_is_reviewed_then_authorized_for_get_on_the_path(
    tmp_path: Path,
) -> None:
    """A valid token whose group may get /metrics: 200, after a TokenReview of that token and
    a SubjectAccessReview for verb get on the non-resource URL /metrics, as that user with its
    uid and groups."""
    async with reviewer(tmp_path) as (api, review):
        api.add_token("t-prom", "system:serviceaccount:monitoring:prometheus", ("monitoring",))
        api.grant("monitoring", "/metrics")
        decision = await review.review("t-prom", "/metrics")
    assert (decision.status, decision.user) == (200, "system:serviceaccount:monitoring:prometheus")
    token_review, access_review = api.reviewed
    assert token_review == {"kind": "TokenReview", "token": "t-prom"}
    assert access_review["kind"] == "SubjectAccessReview"
    assert access_review["user"] == "system:serviceaccount:monitoring:prometheus"
    assert access_review["uid"] == "uid-system:serviceaccount:monitoring:prometheus"
    assert access_review["groups"] == ["monitoring", "system:authenticated"]
    assert access_review["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}


async def test_unknown_token_is_401_without_an_access_review(tmp_path: Path) -> None:
    """A token the TokenReview does not authenticate: 401, and no SubjectAccessReview."""
    async with reviewer(tmp_path) as (api, review):
        decision = await review.review("forged", "/metrics")
    assert decision.status == 401
    assert "invalid bearer token" in decision.reason
    assert [r["kind"] for r in api.reviewed] == ["TokenReview"]


async def test_known_user_without_the_permission_is_403_naming_user_and_path(
    tmp_path: Path,
) -> None:
    """A valid token for a user granted another path only: 403, naming the user and the path."""
    async with reviewer(tmp_path) as (api, review):
        api.add_token("t-dev", "dev")
        api.grant("dev", "/metrics")
        decision = await review.review("t-dev", "/api/status")
    assert (decision.status, decision.user) == (403, "dev")
    assert "dev may not get /api/status" in decision.reason


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("down", "unreachable"),
        ("rbac", "may the EPP's ServiceAccount create tokenreviews"),
        ("slow", "did not answer within 0.2s"),
    ],
)
async def test_an_api_that_cannot_review_raises_instead_of_deciding(
    tmp_path: Path, fault: str, message: str
) -> None:
    """Connections cut, the EPP lacking RBAC for reviews (403 from the API) or an answer past
    the timeout: AccessReviewError saying which, never a 401 or 403 decision."""
    async with reviewer(tmp_path, review_timeout=0.2) as (api, review):
        api.add_token("t", "someone")
        api.reviews_down = fault == "down"
        api.review_status = 403 if fault == "rbac" else 0
        api.review_delay = 1.0 if fault == "slow" else 0.0
        with pytest.raises(AccessReviewError) as info:
            await review.review("t", "/metrics")
    assert message in str(info.value)
