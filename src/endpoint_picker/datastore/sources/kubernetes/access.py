"""Who may read the metrics port: the API server reviews each bearer token (the reference
EPP's ``--metrics-endpoint-auth``, as controller-runtime's metrics filter does it).

Two calls per review, both ``create`` of a review object that the API server answers and never
stores:

1. ``TokenReview`` (``authentication.k8s.io/v1``): is the token valid, and whose is it?
   Not authenticated: 401.
2. ``SubjectAccessReview`` (``authorization.k8s.io/v1``): may that user (with its groups, uid
   and extra) ``get`` the non-resource URL that is the request's path? Not allowed: 403.

A failure to ask (connection refused, timeout, a 5xx, or a 4xx such as the EPP lacking the RBAC
to create reviews) is not a decision: it raises ``AccessReviewError`` and the port answers 503.
Caching, single flight and the once-per-change log are the caller's (``status.auth``), which
knows nothing of Kubernetes; this module is here because only this package may import the
Kubernetes client.
"""

from __future__ import annotations

import asyncio

import httpx2
from lightkube import AsyncClient
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

from endpoint_picker.datastore.sources.kubernetes.reflector import status_code
from endpoint_picker.errors import AccessReviewError
from endpoint_picker.types import AccessDecision

VERB = "get"  # the metrics port only serves GET; RBAC grants it on nonResourceURLs


class KubernetesAccessReviewer:
    """``review(token, path)``: a TokenReview, then a SubjectAccessReview for ``get path``."""

    def __init__(self, client: AsyncClient, timeout: float) -> None:
        self._client = client
        self._timeout = timeout  # seconds for both calls together

    async def review(self, token: str, path: str) -> AccessDecision:
        """The API server's decision; ``AccessReviewError`` when it cannot be asked."""
        try:
            async with asyncio.timeout(self._timeout):
                return await self._review(token, path)
        except TimeoutError as exc:
            raise AccessReviewError(
                f"the Kubernetes API did not answer within {self._timeout:g}s"
            ) from exc
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError is one
            code = status_code(exc)
            hint = (
                " (may the EPP's ServiceAccount create tokenreviews and subjectaccessreviews?"
                " see deploy/kubernetes/rbac.yaml)"
            )
            raise AccessReviewError(
                f"the Kubernetes API refused the review: HTTP {code}: {exc}"
                + (hint if code in (401, 403) else "")
            ) from exc
        except httpx2.HTTPError as exc:  # refused, reset, TLS, protocol
            raise AccessReviewError(
                f"the Kubernetes API is unreachable: {type(exc).__name__}: {exc}"
            ) from exc

    async def _review(self, token: str, path: str) -> AccessDecision:
        tokens = await self._client.create(TokenReview(spec=TokenReviewSpec(token=token)))
        status = tokens.status
        if status is None or not status.authenticated or status.user is None:
            error = status.error if status is not None and status.error else ""
            return AccessDecision(401, f"the token was not accepted{': ' + error if error else ''}")
        user = status.user
        name = user.username or ""
        access = await self._client.create(
            SubjectAccessReview(
                spec=SubjectAccessReviewSpec(
                    user=name,
                    groups=user.groups,
                    uid=user.uid,
                    extra=user.extra,
                    nonResourceAttributes=NonResourceAttributes(path=path, verb=VERB),
                )
            )
        )
        verdict = access.status
        if verdict is not None and verdict.allowed:
            return AccessDecision(200, user=name)
        why = verdict.reason if verdict is not None and verdict.reason else "no RBAC rule allows it"
        return AccessDecision(403, f"{name} may not {VERB} {path}: {why}", user=name)
