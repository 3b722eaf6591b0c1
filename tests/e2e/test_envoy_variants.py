"""Every shipped Envoy configuration, for real: Envoy -> EPP (TLS) -> backends on 127.0.0.x."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.e2e.conftest import Stack
from tests.e2e.harness import SSE_CHUNKS, SSE_DELAY, post

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

DESTINATION = "x-gateway-destination-endpoint"


def _only_delivery(stack: Stack) -> tuple[str, dict[str, str], bytes]:
    """The one request the backends received: (backend, headers, body)."""
    delivered = [(b, r) for b in stack.backends for r in b.received]
    assert len(delivered) == 1, [(b.hostport, r.headers.get(DESTINATION)) for b, r in delivered]
    backend, record = delivered[0]
    return backend.hostport, record.headers, record.body


async def test_requests_land_on_the_endpoint_the_epp_named(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """Each request reaches the backend that is first in the EPP's destination header."""
    served: set[str] = set()
    for _ in range(6):
        for backend in stack.backends:
            backend.received.clear()
        reply = await post(session, stack.envoy.url, {"model": "m", "prompt": "hello"})
        assert reply.status == 200, reply.body
        hostport, headers, _ = _only_delivery(stack)
        named = headers[DESTINATION].split(",")
        assert named[0] == hostport == reply.json["served_by"]
        assert len(named) == (2 if stack.variant == "fallback" else 1)
        served.add(hostport)
    assert served <= {b.hostport for b in stack.backends}


async def test_traffic_split_rewrites_the_model_and_content_length(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """A split model reaches the backend rewritten, with a right (or no: chunked) length."""
    payload = {"model": "split", "prompt": "hi", "temperature": 0.5}
    reply = await post(session, stack.envoy.url, payload)
    assert reply.status == 200, reply.body
    _, headers, body = _only_delivery(stack)
    assert orjson.loads(body) == {**payload, "model": "m-v2"}
    if stack.variant == "buffered":
        assert int(headers["content-length"]) == len(body)
    else:  # Envoy 1.40 forwards a FULL_DUPLEX_STREAMED body chunked, dropping content-length
        assert "content-length" not in headers
        assert headers["transfer-encoding"] == "chunked"


@pytest.mark.parametrize(
    ("payload", "extra", "status", "kind"),
    [
        pytest.param(None, {}, 400, "BadRequest", id="bad-json"),
        pytest.param({"model": "nope", "prompt": "x"}, {}, 404, "NotFound", id="unknown-model"),
        pytest.param(
            {"model": "m", "prompt": "x"},
            {"x-test-subset": "10.9.9.9:1"},
            503,
            "ServiceUnavailable",
            id="empty-subset",
        ),
    ],
)
async def test_epp_errors_reach_the_client_as_json(
    stack: Stack,
    session: aiohttp.ClientSession,
    payload: object,
    extra: dict[str, str],
    status: int,
    kind: str,
) -> None:
    """The EPP's 400/404/503 come back with that status and its JSON error; no backend hit."""
    raw = b"{not json" if payload is None else orjson.dumps(payload)
    reply = await post(session, stack.envoy.url, raw=raw, headers=extra)
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json["error"]
    assert error["type"] == kind
    assert error["code"] == status
    assert error["message"]
    assert stack.all_received() == []


async def test_sse_streams_chunk_by_chunk(stack: Stack, session: aiohttp.ClientSession) -> None:
    """SSE events arrive as the backend writes them (buffered variant: all at once, at the end)."""
    reply = await post(session, stack.envoy.url, {"model": "m", "prompt": "x", "stream": True})
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert len(events) == SSE_CHUNKS + 1
    assert events[-1] == b"data: [DONE]"
    duration = SSE_DELAY * (SSE_CHUNKS - 1)
    spread = reply.chunk_times[-1] - reply.chunk_times[0]
    if stack.variant == "buffered":
        # Envoy holds a BUFFERED response body until it is complete.
        assert reply.chunk_times[0] >= duration * 0.9
    else:
        assert len(reply.chunk_times) >= SSE_CHUNKS - 1
        assert spread >= duration * 0.7, reply.chunk_times


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_300_kb_prompt_passes(
    stack: Stack, session: aiohttp.ClientSession, chunked: bool
) -> None:
    """A 300 KB body (sized or chunked upload) reaches the backend byte for byte."""
    raw = orjson.dumps({"model": "m", "prompt": "y" * 300_000})
    reply = await post(session, stack.envoy.url, raw=raw, chunked=chunked)
    assert reply.status == 200, reply.body
    _, _, body = _only_delivery(stack)
    assert body == raw


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_limit_is_413_before_the_epp(
    stack: Stack, session: aiohttp.ClientSession, chunked: bool
) -> None:
    """Past max_request_bytes Envoy answers 413 with a JSON error; no backend is reached."""
    raw = orjson.dumps({"model": "m", "prompt": "z" * (1024 * 1024 + 10)})
    reply = await post(session, stack.envoy.url, raw=raw, chunked=chunked)
    assert reply.status == 413, reply.body
    assert reply.json["error"]["code"] == 413
    assert stack.all_received() == []


async def test_the_subset_hint_from_envoy_metadata_is_honoured(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """With envoy.lb.subset_hint (a list) set by a filter, every pick comes from that subset."""
    allowed = {stack.backends[1].hostport, stack.backends[2].hostport}
    for _ in range(6):
        reply = await post(
            session,
            stack.envoy.url,
            {"model": "m", "prompt": "x"},
            headers={"x-test-subset": ",".join(sorted(allowed))},
        )
        assert reply.status == 200, reply.body
        assert reply.json["served_by"] in allowed
    assert not stack.backends[0].received
    named = {
        e for b in stack.backends for r in b.received for e in r.headers[DESTINATION].split(",")
    }
    assert named <= allowed


async def test_a_client_sent_destination_header_is_ignored(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """Client-sent x-gateway-destination-endpoint* headers never steer nor reach the backend."""
    target = stack.backends[2].hostport
    spoof = {
        DESTINATION: target,
        f"{DESTINATION}-subset": target,
        f"{DESTINATION}-fallback": target,
    }
    for _ in range(4):
        reply = await post(
            session,
            stack.envoy.url,
            {"model": "m", "prompt": "x"},
            headers={**spoof, "x-test-subset": stack.backends[0].hostport},
        )
        assert reply.status == 200, reply.body
        assert reply.json["served_by"] == stack.backends[0].hostport
    records = stack.backends[0].received
    assert len(records) == 4
    assert not stack.backends[2].received
    for record in records:
        assert record.headers[DESTINATION].split(",")[0] == stack.backends[0].hostport
        assert f"{DESTINATION}-subset" not in record.headers
        assert f"{DESTINATION}-fallback" not in record.headers


async def test_the_epp_cluster_passes_grpc_health_checks_over_tls(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """Envoy's gRPC health check of the EPP (TLS, ext_proc port) reports the EPP healthy."""
    async with session.get(f"{stack.envoy.admin_url}/clusters?format=json") as response:
        clusters = await response.json()
    (epp,) = [c for c in clusters["cluster_statuses"] if c["name"] == "endpoint_picker"]
    (host,) = epp["host_statuses"]
    assert host["address"]["socket_address"]["port_value"] == stack.epp.ports.ext_proc
    assert host["health_status"]["eds_health_status"] == "HEALTHY"
    assert not host["health_status"].get("failed_active_health_check", False)
    async with session.get(
        f"{stack.envoy.admin_url}/stats?filter=endpoint_picker.health_check"
    ) as r:
        stats = dict(line.split(": ", 1) for line in (await r.text()).splitlines() if ": " in line)
    assert int(stats["cluster.endpoint_picker.health_check.success"]) >= 1
    assert int(stats["cluster.endpoint_picker.health_check.failure"]) == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/metrics"),
        ("GET", "/healthz"),
        ("POST", "/v1/completions/../unload_lora_adapter"),
        ("POST", "/v1/completions/%2e%2e/unload_lora_adapter"),
        ("POST", "//v1/unload_lora_adapter"),
        ("GET", "/"),
    ],
)
async def test_a_model_servers_admin_api_is_unreachable(
    stack: Stack, session: aiohttp.ClientSession, method: str, path: str
) -> None:
    """Admin and unknown paths get a JSON 4xx from the gateway and never reach a backend."""
    payload = {"model": "m", "lora_name": "food-review-v1", "prompt": "x"}
    async with session.request(
        method, stack.envoy.url + path, json=payload, skip_auto_headers=()
    ) as reply:
        body = await reply.read()
        assert reply.status in (400, 404), body
        if reply.status == 404:
            assert reply.headers["content-type"] == "application/json"
            assert orjson.loads(body)["error"]["code"] == 404
    assert not any(b.received for b in stack.backends)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_health_is_answered_by_the_gateway(
    stack: Stack, session: aiohttp.ClientSession, method: str
) -> None:
    """GET and HEAD /health get the EPP's empty 200 through Envoy and never reach a pod."""
    async with session.request(method, stack.envoy.url + "/health") as reply:
        assert reply.status == 200
        assert await reply.read() == b""
    assert not any(b.received for b in stack.backends)


async def test_models_are_listed_by_the_gateway(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """GET /v1/models is answered by the EPP from the pool's InferenceModels."""
    async with session.get(stack.envoy.url + "/v1/models") as reply:
        assert reply.status == 200
        listed = orjson.loads(await reply.read())
    assert {m["id"] for m in listed["data"]} == {"m", "split"}
    assert not any(b.received for b in stack.backends)


@pytest.mark.parametrize("extra_headers", [85, 92, 100, 110])
async def test_many_client_headers_get_200_or_a_json_431(
    stack: Stack, session: aiohttp.ClientSession, extra_headers: int
) -> None:
    """Up to Envoy's limit a request either routes or gets a JSON 431, never an empty 500."""
    headers = {f"x-client-{i}": "v" for i in range(extra_headers)}
    reply = await post(session, stack.envoy.url, {"model": "m", "prompt": "x"}, headers=headers)
    if extra_headers <= 85:
        assert reply.status == 200, reply.body
    else:
        assert reply.status == 431, reply.body
        assert reply.json["error"]["type"] == "RequestHeaderFieldsTooLarge"
        assert not any(b.received for b in stack.backends)


async def test_a_huge_model_name_is_not_echoed(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    """A 900 KB unknown model name comes back clipped in a small 404."""
    reply = await post(session, stack.envoy.url, {"model": "x" * 900_000, "prompt": "x"})
    assert reply.status == 404
    assert len(reply.body) < 1000
    assert "[cut: 900000 characters in all]" in reply.json["error"]["message"]
