"""Builders of ext_proc messages, an in-process EPP harness with a real gRPC client, and a fleet
of fake model servers on a clock the test moves (what the latency-learning plugins learn from)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from endpoint_picker.app import App
from endpoint_picker.settings import PoolSettings, ScrapeSettings, ServerSettings, Settings
from tests.support.model_servers import FakeModelServer
from tests.support.pool import pod, pool, pool_yaml

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED


def headers(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    extra: dict[str, str] | None = None,
    end_of_stream: bool = False,
    request_mode: int | None = FULL_DUPLEX,
    response_mode: int = FULL_DUPLEX,
    subset: Sequence[str] | None = None,
) -> pb.ProcessingRequest:
    values = {":path": path, ":method": method, ":authority": "gw", **(extra or {})}
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if request_mode is not None:
        message.protocol_config.request_body_mode = request_mode  # type: ignore[assignment]
        message.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": list(subset)})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body(chunk: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def json_body(obj: Any) -> bytes:
    return orjson.dumps(obj)


def completion(
    model: str = "m", prompt: str = "x", **header_options: Any
) -> list[pb.ProcessingRequest]:
    """A completion request as Envoy sends it: its headers (``header_options`` as ``headers``
    takes them), then its whole JSON body."""
    return [headers(**header_options), body(json_body({"model": model, "prompt": prompt}))]


def response_headers(
    content_type: str = "application/json",
    served: str | None = None,
    status: int = 200,
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    values = [
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()),
    ]
    values += [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in (extra or {}).items()]
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values))
    )
    if served:
        meta = struct_pb2.Struct()
        meta.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    return message


def response_body(chunk: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def header_map(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {
        h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
        for h in mutation.set_headers
    }


def lb_metadata(response: pb.ProcessingResponse) -> str:
    return str(
        response.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


def error_of(response: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    immediate = response.immediate_response
    return immediate.status.code, orjson.loads(immediate.body)


class Client:
    """A real gRPC ext_proc client; each ``exchange`` is one stream."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    async def open(self, messages: Iterable[pb.ProcessingRequest]) -> grpc.aio.StreamStreamCall:
        """A stream with ``messages`` written, left open for the test to read, write or end."""
        call = self.stub.Process()
        for message in messages:
            await call.write(message)
        return call

    async def exchange(
        self, messages: Iterable[pb.ProcessingRequest]
    ) -> list[pb.ProcessingResponse]:
        call = await self.open(messages)
        await call.done_writing()
        return [r async for r in call]

    async def exchange_error(self, messages: Iterable[pb.ProcessingRequest]) -> grpc.StatusCode:
        """The status of a stream expected to fail (AssertionError when it succeeds)."""
        call = self.stub.Process()
        try:
            for message in messages:
                await call.write(message)
            await call.done_writing()
            _ = [r async for r in call]
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        raise AssertionError("the stream succeeded")


def make_settings(
    tmp_path: Path, pool_text: str, *, scraping: bool = False, **pool_overrides: Any
) -> Settings:
    """Settings for an in-process EPP. Without ``scraping`` the scrapers wait an hour between
    scrapes: the pods of most tests have no server, and a refused scrape would mark them
    unreachable in the middle of a test that counts endpoints."""
    pool_file = tmp_path / "pool.yaml"
    pool_file.write_text(pool_text)
    scrape = (
        ScrapeSettings()
        if scraping
        else ScrapeSettings(refresh_interval=3600.0, staleness_threshold=36000.0)
    )
    return Settings(
        scrape=scrape,
        server=ServerSettings(
            bind_address="127.0.0.1",
            grpc_port=0,
            grpc_health_port=0,
            metrics_port=0,
            secure_serving=False,
            drain_timeout=2.0,
        ),
        pool=replace(
            PoolSettings(pool_file=pool_file, reload_poll_interval=0.05), **pool_overrides
        ),
    )


@contextlib.asynccontextmanager
async def started_app(
    settings: Settings, *, drain_timeout: float = 0.5, **app_kwargs: Any
) -> AsyncIterator[App]:
    """An in-process EPP, started, and stopped with ``drain_timeout`` however the block ends."""
    app = App(settings, **app_kwargs)
    await app.start()
    try:
        yield app
    finally:
        await app.stop(drain_timeout=drain_timeout)


@contextlib.asynccontextmanager
async def running_app(settings: Settings, **app_kwargs: Any) -> AsyncIterator[tuple[App, Client]]:
    async with (
        started_app(settings, **app_kwargs) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.ports.ext_proc}") as channel,
    ):
        yield app, Client(channel)


# -- an EPP over a fleet of fake model servers, on a clock the test moves ---------------------


class FakeClock:
    """Monotonic time the test moves by hand: staleness never depends on machine load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet_settings(
    tmp_path: Path,
    servers: Sequence[FakeModelServer],
    *models: dict[str, Any],
    config: str | None = None,
    staleness_threshold: float = 2.0,
) -> Settings:
    """Settings for an EPP whose pool is ``servers`` (a pod each) serving ``models``, scraped
    every 20 ms, scheduled by ``config`` (the default profile without)."""
    pods = [pod(f"p{i}", s.address) for i, s in enumerate(servers)]
    settings = make_settings(tmp_path, pool_yaml(pool(port=servers[0].port), *models, *pods))
    scheduling = settings.scheduling
    if config is not None:
        config_file = tmp_path / "config.yaml"
        config_file.write_text(config)
        scheduling = replace(scheduling, config_file=config_file)
    return replace(
        settings,
        scrape=replace(
            settings.scrape, refresh_interval=0.02, staleness_threshold=staleness_threshold
        ),
        scheduling=scheduling,
    )


async def wait_for_metrics(app: App, check: Callable[[App], bool], within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check(app):
        assert asyncio.get_running_loop().time() < deadline, "metrics did not arrive in time"
        await asyncio.sleep(0.02)


def all_scraped_at(clock: FakeClock) -> Callable[[App], bool]:
    def check(app: App) -> bool:
        return all(s.metrics.updated_at == clock.now for s in app.datastore.endpoint_states())

    return check


async def timed_request(
    client: Client,
    clock: FakeClock,
    payload: dict[str, Any],
    seconds: float,
    chunks: Sequence[bytes],
    *,
    content_type: str = "application/json",
    subset: list[str] | None = None,
) -> str:
    """One request of ``payload``, routed (within ``subset``), whose response of
    ``content_type`` brings its body (``chunks``) ``seconds`` of the EPP's clock after its
    headers; the endpoint it went to."""
    call = client.stub.Process()
    await call.write(headers(subset=subset))
    await call.write(body(json_body(payload)))
    routing = await call.read()
    await call.read()  # the request body, streamed back
    await call.write(response_headers(content_type))
    clock.now += seconds
    for i, chunk in enumerate(chunks):
        await call.write(response_body(chunk, i == len(chunks) - 1))
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # the response path's answers
        pass
    return lb_metadata(routing)
