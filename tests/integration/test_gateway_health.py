"""The gateway's own /health, and a pool whose pods all turn NotReady, through the real gRPC
server in process (both ext_proc stacks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from tests.support.extproc import (
    Client,
    completion,
    error_of,
    headers,
    make_settings,
    running_app,
)
from tests.support.polling import until
from tests.support.pool import model, pod, pool, pool_yaml

from endpoint_picker.app import App

pytestmark = [pytest.mark.usefixtures("ext_proc_server"), pytest.mark.timeout(20)]

READY = pool_yaml(pool(), model("m"), pod("a", "127.0.0.2"), pod("b", "127.0.0.3"))
UNREADY = pool_yaml(
    pool(), model("m"), pod("a", "127.0.0.2", ready=False), pod("b", "127.0.0.3", ready=False)
)


async def health(client: Client, method: str = "GET") -> pb.ImmediateResponse:
    """One /health request as Envoy sends it (headers only): the EPP's one answer."""
    (out,) = await client.exchange([headers("/health", method=method, end_of_stream=True)])
    assert out.HasField("immediate_response"), out
    return out.immediate_response


def errors_counted(app: App) -> float:
    samples = app.metrics.registry.collect()
    return sum(
        s.value
        for family in samples
        if family.name == "inference_model_request_error"
        for s in family.samples
        if s.name.endswith("_total")
    )


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_health_is_an_empty_200_while_the_pool_has_a_ready_endpoint(
    tmp_path: Path, method: str
) -> None:
    """GET and HEAD /health are answered by the EPP itself (an empty 200, as vLLM's), on the
    headers: no routing header, nothing for Envoy to send to a pod."""
    async with running_app(make_settings(tmp_path, READY)) as (_, client):
        answer = await health(client, method)
    assert answer.status.code == 200
    assert answer.body == b""
    assert answer.details == "epp_health"


async def test_health_with_a_body_is_answered_on_the_headers(tmp_path: Path) -> None:
    """A /health request that announces a body is answered before any of it is held."""
    async with running_app(make_settings(tmp_path, READY)) as (_, client):
        out = await client.exchange([headers("/health", method="POST")])
    assert len(out) == 1
    assert out[0].immediate_response.status.code == 200


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_health_is_a_json_503_without_a_ready_endpoint(tmp_path: Path, method: str) -> None:
    """No ready endpoint: a JSON 503 like the EPP's other errors, not counted as a failed
    request and not shown as a refused decision (a probe every second would bury them)."""
    async with running_app(make_settings(tmp_path, UNREADY)) as (app, client):
        answer = await health(client, method)
        assert errors_counted(app) == 0
        assert len(app.decisions) == 0
    assert answer.status.code == 503
    status, error = error_of(pb.ProcessingResponse(immediate_response=answer))
    assert status == 503
    assert error["error"]["type"] == "ServiceUnavailable"
    assert error["error"]["message"] == "no ready endpoint in the pool"


async def test_pool_edit_marking_every_pod_not_ready_serves_503(tmp_path: Path) -> None:
    """A complete pool file that marks every pod NotReady applies: requests and /health get
    503 at once (nothing goes to pods the file calls unready); marked Ready again, they route."""
    settings = make_settings(tmp_path, READY, reload_settle_time=0.05)
    async with running_app(settings) as (app, client):
        assert (await health(client)).status.code == 200
        assert settings.pool.pool_file is not None
        settings.pool.pool_file.write_text(UNREADY)
        await until(lambda: not app.datastore.endpoints)
        status, error = error_of((await client.exchange(completion()))[0])
        assert (status, error["error"]["message"]) == (503, "no ready endpoint in the pool")
        assert (await health(client)).status.code == 503
        settings.pool.pool_file.write_text(READY)
        await until(lambda: len(app.datastore.endpoints) == 2)
        assert (await health(client)).status.code == 200
