"""A Kubernetes API-server double over real HTTP (aiohttp): list and watch, nothing else.

Serves namespaced collections (``/api/v1/namespaces/NS/pods``,
``/apis/GROUP/VERSION/namespaces/NS/PLURAL``) the way the real server does: a list carries the
collection's ``resourceVersion``; ``?watch=true`` streams JSON lines (chunked) of ADDED,
MODIFIED and DELETED events after the given version, ends the stream after ``timeoutSeconds``,
and answers a version older than the compaction point with an ERROR event holding a 410 Status.
Only ``fieldSelector=metadata.name=X`` is understood (all the EPP uses). Tests mutate objects
with ``put``/``delete`` and inject faults with ``expire`` (410 mid-watch) and ``drop`` (the
connection cut mid-stream).

It also reviews bearer tokens, as the metrics port asks it to: ``TokenReview``
(``authentication.k8s.io/v1``) knows the tokens tests register with ``add_token`` and
``SubjectAccessReview`` (``authorization.k8s.io/v1``) allows ``get`` on the non-resource paths
granted to a user or one of its groups with ``grant``. Each review is counted (``reviews``,
``reviewed``); ``reviews_down`` cuts review connections (an API server that is unreachable),
``review_status`` answers them with an error status, ``review_delay`` slows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tests.support.model_servers import free_port

Key = tuple[str, str]  # (apiVersion, plural)

_DROP = "DROP"


def key_of(obj: dict[str, Any]) -> Key:
    kind = str(obj["kind"])
    return str(obj["apiVersion"]), kind.lower() + "s"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _json(obj: Any, status: int = 200) -> web.Response:
    """JSON the way the API server sends it: ``application/json`` with no charset (lightkube
    only turns an error body into an ``ApiError`` on that exact content type)."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@dataclass
class _Watch:
    key: Key
    namespace: str
    name: str | None
    queue: asyncio.Queue[tuple[str, dict[str, Any]] | str] = field(default_factory=asyncio.Queue)


class FakeKubeApi:
    """The double's state and controls; ``serve_kube_api`` runs it on 127.0.0.x."""

    def __init__(self) -> None:
        self.version = 100
        self.objects: dict[Key, dict[tuple[str, str], dict[str, Any]]] = {}
        self.history: dict[Key, list[tuple[int, str, dict[str, Any]]]] = {}
        self.compacted = 0  # a watch from a version below this gets 410 Gone
        self.watches: list[_Watch] = []
        self.log: list[str] = []  # "list pods", "watch pods from 103", ...
        self.served: set[Key] = {
            ("v1", "pods"),
            ("inference.networking.x-k8s.io/v1alpha2", "inferencepools"),
            ("inference.networking.x-k8s.io/v1alpha2", "inferencemodels"),
            ("inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives"),
            ("inference.networking.k8s.io/v1", "inferencepools"),
            ("coordination.k8s.io/v1", "leases"),
        }
        self.url = ""
        self.failing_lists = 0  # the next this many lists answer 500 (an API server in trouble)
        # token reviews
        self.tokens: dict[str, dict[str, Any]] = {}  # token -> UserInfo
        self.grants: set[tuple[str, str]] = set()  # (user or group, non-resource path): get
        self.reviewed: list[dict[str, Any]] = []  # every review's spec, in order
        self.reviews_down = False  # cut every review connection (unreachable)
        self.review_status = 0  # answer reviews with this error status (e.g. 403: no RBAC)
        self.review_delay = 0.0  # seconds each review takes

    # -- controls ------------------------------------------------------------------------------

    def put(self, obj: dict[str, Any]) -> None:
        """Create or replace an object: ADDED or MODIFIED to the watches."""
        obj = copy.deepcopy(obj)
        key = key_of(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault(
            "creationTimestamp",
            datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        ident = (meta["namespace"], meta["name"])
        store = self.objects.setdefault(key, {})
        event = "MODIFIED" if ident in store else "ADDED"
        self._record(key, event, obj)
        store[ident] = obj

    def delete(self, obj: dict[str, Any]) -> None:
        """Delete the object with this kind, namespace and name: DELETED to the watches."""
        key = key_of(obj)
        meta = obj["metadata"]
        gone = self.objects.get(key, {}).pop((meta.get("namespace", "default"), meta["name"]))
        self._record(key, "DELETED", copy.deepcopy(gone))

    def expire(self) -> None:
        """Compact history past now: open watches get a 410 ERROR event, and so does any
        watch from an older version, until the client lists again."""
        self.compacted = self.version + 1
        self.version += 1
        for watch in self.watches:
            watch.queue.put_nowait(("ERROR", _status(410, "Expired", "too old resource version")))

    def drop(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk)."""
        for watch in self.watches:
            watch.queue.put_nowait(_DROP)

    def add_token(self, token: str, user: str, groups: tuple[str, ...] = ()) -> None:
        """A token the TokenReview accepts, for ``user`` in ``groups``."""
        self.tokens[token] = {
            "username": user,
            "uid": f"uid-{user}",
            "groups": [*groups, "system:authenticated"],
        }

    def grant(self, subject: str, *paths: str) -> None:
        """Let a user or group ``get`` these non-resource URLs (a ClusterRole's nonResourceURLs)."""
        self.grants.update((subject, path) for path in paths)

    @property
    def reviews(self) -> int:
        """API calls made to review tokens (TokenReviews and SubjectAccessReviews)."""
        return len(self.reviewed)

    def count(self, entry: str) -> int:
        return sum(1 for line in self.log if line.startswith(entry))

    def _record(self, key: Key, event: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.setdefault(key, []).append((self.version, event, obj))
        for watch in self.watches:
            if watch.key == key and self._matches(watch, obj):
                watch.queue.put_nowait((event, obj))

    @staticmethod
    def _matches(watch: _Watch, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return meta["namespace"] == watch.namespace and watch.name in (None, meta["name"])

    # -- HTTP ----------------------------------------------------------------------------------

    def _key(self, request: web.Request) -> Key:
        parts = request.match_info
        api = parts["version"] if "group" not in parts else f"{parts['group']}/{parts['version']}"
        return str(api), parts["plural"]

    async def handle_object(self, request: web.Request) -> web.StreamResponse:
        """GET or PUT one object (PUT checks metadata.resourceVersion: 409 when stale)."""
        key = self._key(request)
        ident = (request.match_info["namespace"], request.match_info["name"])
        if key not in self.served:
            return _json(_status(404, "NotFound", "no such kind"), status=404)
        current = self.objects.get(key, {}).get(ident)
        self.log.append(f"{request.method.lower()} {key[1]}/{ident[1]}")
        if current is None:
            return _json(_status(404, "NotFound", f"{ident[1]} not found"), status=404)
        if request.method == "GET":
            return _json(current)
        obj = await request.json()
        sent = obj.get("metadata", {}).get("resourceVersion")
        if sent != current["metadata"]["resourceVersion"]:
            return _json(_status(409, "Conflict", "the object has been modified"), status=409)
        obj["metadata"]["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        self.put(obj)
        return _json(self.objects[key][ident])

    async def handle_create(self, request: web.Request) -> web.StreamResponse:
        """POST to a collection: 201, or 409 when the name exists."""
        key = self._key(request)
        obj = await request.json()
        obj["metadata"]["namespace"] = request.match_info["namespace"]
        ident = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.log.append(f"create {key[1]}/{ident[1]}")
        if key not in self.served:
            return _json(_status(404, "NotFound", "no such kind"), status=404)
        if ident in self.objects.get(key, {}):
            return _json(_status(409, "AlreadyExists", "already exists"), status=409)
        obj.setdefault("apiVersion", key[0])
        self.put(obj)
        return _json(self.objects[key][ident], status=201)

    async def _review_request(self, request: web.Request) -> dict[str, Any] | None:
        """The review's body, or None when the double plays an unreachable server."""
        obj: dict[str, Any] = await request.json()
        self.reviewed.append({"kind": obj.get("kind"), **obj.get("spec", {})})
        if self.review_delay:
            await asyncio.sleep(self.review_delay)
        if self.reviews_down:
            if request.transport is not None:
                request.transport.abort()
            return None
        return obj

    async def handle_token_review(self, request: web.Request) -> web.StreamResponse:
        obj = await self._review_request(request)
        if obj is None:
            return web.Response(status=500)  # never sent: the connection is gone
        if self.review_status:
            reason = "Forbidden" if self.review_status == 403 else "InternalError"
            return _json(_status(self.review_status, reason, "review refused"), self.review_status)
        user = self.tokens.get(obj["spec"]["token"])
        status: dict[str, Any] = (
            {"authenticated": True, "user": user, "audiences": ["https://kubernetes.default.svc"]}
            if user is not None
            else {"authenticated": False, "error": "invalid bearer token"}
        )
        return _json({**obj, "status": status}, status=201)

    async def handle_access_review(self, request: web.Request) -> web.StreamResponse:
        obj = await self._review_request(request)
        if obj is None:
            return web.Response(status=500)
        if self.review_status:
            return _json(_status(self.review_status, "Forbidden", "review refused"), 403)
        spec = obj["spec"]
        attributes = spec.get("nonResourceAttributes") or {}
        subjects = {spec.get("user"), *(spec.get("groups") or [])}
        allowed = attributes.get("verb") == "get" and any(
            (subject, attributes.get("path")) in self.grants for subject in subjects
        )
        status = {"allowed": allowed} if allowed else {"allowed": False, "reason": "no rule"}
        return _json({**obj, "status": status}, status=201)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        parts = request.match_info
        api = (
            parts.get("version") if "group" not in parts else f"{parts['group']}/{parts['version']}"
        )
        key: Key = (str(api), parts["plural"])
        namespace = parts["namespace"]
        if key not in self.served:
            return _json(_status(404, "NotFound", "the server could not find it"), status=404)
        name = None
        selector = request.query.get("fieldSelector", "")
        if selector.startswith("metadata.name="):
            name = selector.removeprefix("metadata.name=")
        watch = _Watch(key, namespace, name)
        if request.query.get("watch") == "true":
            return await self._watch(request, watch)
        self.log.append(f"list {key[1]}")
        if self.failing_lists > 0:
            self.failing_lists -= 1
            return _json(_status(500, "InternalError", "etcd unavailable"), status=500)
        items = [o for o in self.objects.get(key, {}).values() if self._matches(watch, o)]
        return _json(
            {
                "kind": "List",
                "apiVersion": key[0],
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, watch: _Watch) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.version)
        timeout = float(request.query.get("timeoutSeconds") or 60)
        self.log.append(f"watch {watch.key[1]} from {since}")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.compacted:
            gone = _status(410, "Expired", f"too old resource version: {since}")
            await response.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            await response.write_eof()
            return response
        for version, event, obj in self.history.get(watch.key, []):
            if version > since and self._matches(watch, obj):
                watch.queue.put_nowait((event, obj))
        self.watches.append(watch)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    item = await watch.queue.get()
                    if item == _DROP:
                        if request.transport is not None:
                            request.transport.abort()
                        return response
                    event, obj = item
                    await response.write(orjson.dumps({"type": event, "object": obj}) + b"\n")
                    if event == "ERROR":
                        break
        except TimeoutError:
            pass
        finally:
            self.watches.remove(watch)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    """A kubeconfig naming the double (plain HTTP, no credentials)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [
            {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
        ],
        "current-context": "fake",
    }
    path.write_bytes(orjson.dumps(config))  # JSON is YAML
    return path


@contextlib.asynccontextmanager
async def serve_kube_api(address: str = "127.0.0.9") -> AsyncIterator[FakeKubeApi]:
    """Run the double on ``address`` until the block ends (open watches are cut then)."""
    api = FakeKubeApi()
    app = web.Application()
    app.router.add_get("/api/{version}/namespaces/{namespace}/{plural}", api.handle)
    app.router.add_get("/apis/{group}/{version}/namespaces/{namespace}/{plural}", api.handle)
    collection = "/apis/{group}/{version}/namespaces/{namespace}/{plural}"
    app.router.add_post(collection, api.handle_create)
    app.router.add_get(collection + "/{name}", api.handle_object)
    app.router.add_put(collection + "/{name}", api.handle_object)
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", api.handle_token_review)
    app.router.add_post(
        "/apis/authorization.k8s.io/v1/subjectaccessreviews", api.handle_access_review
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port(address)
    await web.TCPSite(runner, address, port).start()
    api.url = f"http://{address}:{port}"
    try:
        yield api
    finally:
        api.drop()
        await runner.cleanup()
