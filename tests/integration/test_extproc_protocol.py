"""The EPP protocol end to end through the real gRPC server, in process."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import orjson
import pytest
from tests.support.extproc import (
    BUFFERED,
    FULL_DUPLEX,
    Mode,
    body,
    completion,
    error_of,
    header_map,
    headers,
    json_body,
    lb_metadata,
    make_settings,
    response_body,
    response_headers,
    running_app,
)
from tests.support.pool import V1, model, pod, pool, pool_yaml

# each test runs on both gRPC stacks of the ext_proc port (tests/integration/conftest.py)
pytestmark = pytest.mark.usefixtures("ext_proc_server")

PODS = (pod("a", "127.0.0.2"), pod("b", "127.0.0.3"))
ENDPOINTS = {"127.0.0.2:8000", "127.0.0.3:8000"}
BASIC = pool_yaml(pool(), model("m"), model("split", targets={"m-v2": 1}), *PODS)


async def test_full_duplex_routes_after_the_body_and_streams_it_back(tmp_path: Path) -> None:
    """Full duplex: nothing on headers; then headers response (header == metadata), body chunks."""
    prompt = "x" * 150_000
    raw = json_body({"model": "m", "prompt": prompt})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(
            [
                headers(),
                body(raw[:70_000], False),
                body(raw[70_000:100_000], False),
                body(raw[100_000:]),
            ]
        )
    first = out[0]
    assert first.WhichOneof("response") == "request_headers"
    assert first.request_headers.response.clear_route_cache
    set_headers = header_map(first.request_headers.response.header_mutation)
    destination = set_headers["x-gateway-destination-endpoint"]
    assert destination in ENDPOINTS
    assert lb_metadata(first) == destination
    assert set_headers["content-length"] == str(len(raw))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(c.body for c in chunks) == raw
    assert all(len(c.body) <= 62_000 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_absent_protocol_config_means_full_duplex(tmp_path: Path) -> None:
    """Without protocol_config the stream is treated as FULL_DUPLEX_STREAMED."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(completion("m", "hi", request_mode=None))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]


async def test_buffered_mode_routes_on_the_body_response(tmp_path: Path) -> None:
    """Buffered: headers continue at once; the body response carries routing, rewrite, metadata."""
    raw = json_body({"model": "split", "prompt": "hi", "temperature": 0.5})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(
            [headers(request_mode=BUFFERED, response_mode=BUFFERED), body(raw)]
        )
    assert out[0].WhichOneof("response") == "request_headers"
    assert not out[0].request_headers.response.HasField("header_mutation")
    common = out[1].request_body.response
    destination = header_map(common.header_mutation)["x-gateway-destination-endpoint"]
    assert lb_metadata(out[1]) == destination in ENDPOINTS
    rewritten = orjson.loads(common.body_mutation.body)
    assert rewritten == {"model": "m-v2", "prompt": "hi", "temperature": 0.5}
    assert header_map(common.header_mutation)["content-length"] == str(
        len(common.body_mutation.body)
    )


@pytest.mark.parametrize("mode", [Mode.STREAMED, Mode.NONE, Mode.BUFFERED_PARTIAL])
async def test_unsupported_body_modes_are_500(tmp_path: Path, mode: int) -> None:
    """STREAMED, NONE and BUFFERED_PARTIAL request body modes answer a clear 500."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(request_mode=mode)])
    status, error = error_of(out[0])
    assert status == 500
    assert "not supported" in error["error"]["message"]


@pytest.mark.parametrize(
    ("path", "payload", "status", "kind"),
    [
        ("/v1/completions", b"{oops", 400, "BadRequest"),
        ("/v1/chat/completions", b'{"model": "m"}', 400, "BadRequest"),
        ("/v1/completions", b'{"model": "unknown", "prompt": "x"}', 404, "NotFound"),
    ],
)
async def test_errors_are_immediate_json_responses(
    tmp_path: Path, path: str, payload: bytes, status: int, kind: str
) -> None:
    """Bad bodies and unknown models end the stream with the status and an OpenAI error body."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(path), body(payload)])
    assert len(out) == 1
    code, error = error_of(out[0])
    assert (code, error["error"]["type"], error["error"]["code"]) == (status, kind, status)
    content_type = header_map(out[0].immediate_response.headers)["content-type"]
    assert content_type == "application/json"


async def test_subset_hint_honoured_and_empty_subset_is_503(tmp_path: Path) -> None:
    """The subset hint in filter metadata restricts the pick; an ineligible one is 503."""
    raw = json_body({"model": "m", "prompt": "x"})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        for _ in range(5):
            out = await client.exchange([headers(subset=["127.0.0.3:8000"]), body(raw)])
            assert lb_metadata(out[0]) == "127.0.0.3:8000"
        ineligible = await client.exchange([headers(subset=["10.9.9.9:1"]), body(raw)])
        empty = await client.exchange([headers(subset=[]), body(raw)])
    assert error_of(ineligible[0])[0] == 503
    status, error = error_of(empty[0])
    assert (status, error["error"]["message"]) == (503, "the subset hint is empty")


async def test_client_sent_destination_headers_are_ignored_and_removed(tmp_path: Path) -> None:
    """A client-sent destination header never decides the upstream and is removed."""
    spoof = {
        "x-gateway-destination-endpoint": "6.6.6.6:80",
        "x-gateway-destination-endpoint-subset": "6.6.6.6:80",
    }
    raw = json_body({"model": "m", "prompt": "x"})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(extra=spoof), body(raw)])
    mutation = out[0].request_headers.response.header_mutation
    # the destination is overwritten with the EPP's pick, every other variant removed
    assert header_map(mutation)["x-gateway-destination-endpoint"] in ENDPOINTS
    assert list(mutation.remove_headers) == ["x-gateway-destination-endpoint-subset"]
    assert lb_metadata(out[0]) == header_map(mutation)["x-gateway-destination-endpoint"]


async def test_headers_only_request_routes_at_once(tmp_path: Path) -> None:
    """A GET with no body is routed on its headers (a v1 pool lets a server list models)."""
    text = pool_yaml(pool(api=V1), *PODS)
    async with running_app(make_settings(tmp_path, text)) as (_, client):
        out = await client.exchange([headers("/v1/models", method="GET", end_of_stream=True)])
    assert lb_metadata(out[0]) in ENDPOINTS


async def test_models_are_listed_by_the_epp(tmp_path: Path) -> None:
    """GET /v1/models is answered by the EPP with the pool's InferenceModels, never routed."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers("/v1/models", method="GET", end_of_stream=True)])
    immediate = out[0].immediate_response
    assert immediate.status.code == 200
    assert [m["id"] for m in orjson.loads(immediate.body)["data"]] == ["m", "split"]


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/v1/unload_lora_adapter", "POST"),
        ("/v1/load_lora_adapter", "POST"),
        ("/metrics", "GET"),
        ("/healthz", "GET"),  # /health is the gateway's own (test_gateway_health.py)
        ("/v1/completions/../unload_lora_adapter", "POST"),
    ],
)
async def test_admin_paths_are_404_on_the_headers(tmp_path: Path, path: str, method: str) -> None:
    """A model server's admin API is a JSON 404 on the headers: nothing routed, nothing held."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(path, method=method)])
    assert len(out) == 1
    status, answer = error_of(out[0])
    assert status == 404
    assert "not an inference API" in answer["error"]["message"]


async def test_envoy_connect_failure_takes_the_endpoint_out(tmp_path: Path) -> None:
    """Envoy's connect-failure 503 for the picked endpoint: later requests go elsewhere."""
    raw = json_body({"model": "m", "prompt": "x"})
    settings = make_settings(tmp_path, BASIC)
    # nothing listens at the pods: scrapes hours apart, so only Envoy's report can mark them
    settings = replace(
        settings,
        scrape=replace(settings.scrape, refresh_interval=3600, staleness_threshold=36000),
    )
    async with running_app(settings) as (app, client):
        out = await client.exchange(
            [
                headers(),
                body(raw),
                response_headers(status=503, extra={"x-gateway-upstream-failure": "connect"}),
                response_body(b"{}"),
            ]
        )
        dead = lb_metadata(out[0])
        assert app.datastore.unreachable.keys() == {dead}
        for _ in range(6):
            again = await client.exchange([headers(), body(raw)])
            assert lb_metadata(again[0]) != dead


async def test_no_ready_pods_is_503(tmp_path: Path) -> None:
    """A pool without Ready pods answers 503, for bodies and for headers-only requests."""
    text = pool_yaml(pool(api=V1), pod("a", "127.0.0.2", ready=False))
    async with running_app(make_settings(tmp_path, text)) as (_, client):
        with_body = await client.exchange(completion())
        no_body = await client.exchange([headers("/v1/models", method="GET", end_of_stream=True)])
    assert error_of(with_body[0])[0] == 503
    assert error_of(no_body[0])[0] == 503


async def test_v1_pool_passes_unknown_models(tmp_path: Path) -> None:
    """A v1 InferencePool routes any model."""
    text = pool_yaml(pool(api=V1), *PODS)
    async with running_app(make_settings(tmp_path, text)) as (_, client):
        out = await client.exchange(completion("any"))
    assert lb_metadata(out[0]) in ENDPOINTS


async def test_fallback_endpoints_listed(tmp_path: Path) -> None:
    """--max-fallback-endpoints 1 lists two distinct endpoints, same in header and metadata."""
    settings = make_settings(tmp_path, BASIC)
    settings = replace(settings, scheduling=replace(settings.scheduling, max_fallback_endpoints=1))
    async with running_app(settings) as (_, client):
        out = await client.exchange(completion())
    destination = lb_metadata(out[0])
    assert set(destination.split(",")) == ENDPOINTS
    assert (
        header_map(out[0].request_headers.response.header_mutation)[
            "x-gateway-destination-endpoint"
        ]
        == destination
    )


async def test_response_chunks_pass_at_once_unchanged(tmp_path: Path) -> None:
    """Full duplex response: each chunk is answered at once, unchanged, end_of_stream kept."""
    sse = [
        b'data: {"choices": [{"text": "a"}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n',
        b"data: [DONE]\n\n",
    ]
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        call = client.stub.Process()
        await call.write(headers())
        await call.write(body(json_body({"model": "m", "prompt": "x", "stream": True})))
        routed = [await call.read(), await call.read()]
        await call.write(response_headers("text/event-stream"))
        assert (await call.read()).WhichOneof("response") == "response_headers"
        for i, chunk in enumerate(sse):
            await call.write(response_body(chunk, end_of_stream=i == len(sse) - 1))
            answer = (await call.read()).response_body.response.body_mutation.streamed_response
            assert (answer.body, answer.end_of_stream) == (chunk, i == len(sse) - 1)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    assert routed[0].WhichOneof("response") == "request_headers"


async def test_buffered_response_goes_back_unchanged(tmp_path: Path) -> None:
    """Buffered response mode: the body response is a plain continue."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(
            [
                *completion(request_mode=FULL_DUPLEX, response_mode=BUFFERED),
                response_headers(),
                response_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'),
            ]
        )
    last = out[-1]
    assert last.WhichOneof("response") == "response_body"
    assert not last.response_body.response.HasField("body_mutation")


async def test_request_trailers_end_the_body(tmp_path: Path) -> None:
    """HTTP/2 trailers after a body without end_of_stream route the request, then continue."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(
            [
                headers(),
                body(json_body({"model": "m", "prompt": "x"}), end_of_stream=False),
                pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            ]
        )
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream


async def test_cancelled_stream_leaves_nothing_behind(tmp_path: Path) -> None:
    """A stream cancelled mid-body leaves no task and no running-request count behind."""
    async with running_app(make_settings(tmp_path, BASIC)) as (app, client):
        await asyncio.sleep(0.1)  # let start-up tasks settle
        before = {t.get_name() for t in asyncio.all_tasks()}
        call = client.stub.Process()
        await call.write(headers())
        await call.write(body(b'{"model": "m", "pro', end_of_stream=False))
        call.cancel()
        # A routed request abandoned before its response must not stay counted as running.
        call2 = client.stub.Process()
        await call2.write(headers())
        await call2.write(body(json_body({"model": "m", "prompt": "x"})))
        await call2.read()
        call2.cancel()
        for _ in range(100):
            await asyncio.sleep(0.02)
            running = app.metrics.running_requests.labels("m")._value.get()
            if running == 0:
                break
        assert running == 0
        # grpc's server keeps one task waiting for the next call: not a leak of ours
        extra = [
            t
            for t in asyncio.all_tasks()
            if t.get_name() not in before and "AioServer._request" not in repr(t)
        ]
        assert not extra, [t.get_coro() for t in extra]


async def test_body_over_the_limit_is_413_and_forgotten(tmp_path: Path) -> None:
    """A body over the EPP's limit is refused with 413 before it is all buffered."""
    settings = make_settings(tmp_path, BASIC)
    settings = replace(settings, server=replace(settings.server, max_request_body_bytes=100_000))
    async with running_app(settings) as (_, client):
        out = await client.exchange(
            [headers(), body(b"x" * 60_000, False), body(b"x" * 60_000, False), body(b"}")]
        )
    status, error = error_of(out[0])
    assert (status, error["error"]["type"]) == (413, "PayloadTooLarge")
    assert len(out) == 1


async def test_buffered_body_before_trailers_is_routed(tmp_path: Path) -> None:
    """BUFFERED with trailers: the body (no end_of_stream) is routed, then trailers continue."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    raw = json_body({"model": "m", "prompt": "x"})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange(
            [
                headers(request_mode=BUFFERED, response_mode=BUFFERED),
                body(raw, end_of_stream=False),
                pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            ]
        )
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    assert lb_metadata(out[1]) in ENDPOINTS


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_inference_post_without_body_is_400(tmp_path: Path, path: str) -> None:
    """A completion request whose headers end the stream has no body to route on: 400."""
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(path, end_of_stream=True)])
    assert error_of(out[0])[0] == 400


async def test_unexpected_exception_is_a_json_500(tmp_path: Path) -> None:
    """A bug below the edge still answers a JSON 500 and ends the stream cleanly."""
    async with running_app(make_settings(tmp_path, BASIC)) as (app, client):

        def broken(*_: object) -> None:
            raise RuntimeError("boom")

        app.datastore.endpoint_states = broken  # type: ignore[method-assign]
        out = await client.exchange(completion())
    status, error = error_of(out[0])
    assert (status, error["error"]["type"]) == (500, "Internal")
    assert "boom" not in error["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        # 3 pseudo-headers + content-length + 95 = 99, + the destination header = 100: fits
        ({"content-length": "10", **{f"x-{i}": "v" for i in range(95)}}, None),
        # without a content-length the EPP adds one too: 101 would not fit
        ({f"x-{i}": "v" for i in range(96)}, 431),
        ({"content-length": "10", **{f"x-{i}": "v" for i in range(96)}}, 431),
        ({"x-big": "v" * 61_000}, 431),  # past 60 KiB of headers
    ],
)
async def test_headers_leave_room_for_the_epps_own(
    tmp_path: Path, extra: dict[str, str], status: int | None
) -> None:
    """A request whose headers leave no room for the EPP's mutation is a JSON 431 at once."""
    raw = json_body({"model": "m", "prompt": "x"})
    async with running_app(make_settings(tmp_path, BASIC)) as (_, client):
        out = await client.exchange([headers(extra=extra), body(raw)])
    if status is None:
        assert lb_metadata(out[0]) in ENDPOINTS
    else:
        assert len(out) == 1
        code, answer = error_of(out[0])
        assert (code, answer["error"]["type"]) == (431, "RequestHeaderFieldsTooLarge")
