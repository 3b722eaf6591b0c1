"""The EPP keys its own bookkeeping by ids it makes, never by the client's ``x-request-id``."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest
from tests.integration.test_flow_control import IDLE, scraped
from tests.support.extproc import body, headers, json_body, lb_metadata, make_settings, running_app
from tests.support.model_servers import fake_model_servers
from tests.support.polling import until
from tests.support.pool import model, pod, pool, pool_yaml

# each test runs on both gRPC stacks of the ext_proc port (tests/integration/conftest.py)
pytestmark = pytest.mark.usefixtures("ext_proc_server")

ADDRS = ["127.0.4.2", "127.0.4.3"]


async def test_requests_sharing_a_client_request_id_are_counted_one_by_one(
    tmp_path: Path,
) -> None:
    """20 requests in flight at once, all with the same x-request-id, count as 20 in flight
    and split evenly over two equal pods; all 20 finish (the count returns to 0)."""
    async with fake_model_servers(ADDRS) as servers:
        for server in servers:
            server.metrics_text = IDLE
        text = pool_yaml(
            pool(port=servers[0].port),
            model("m"),
            *(pod(f"p{i}", s.address) for i, s in enumerate(servers)),
        )
        async with running_app(make_settings(tmp_path, text, scraping=True)) as (app, client):
            await until(lambda: scraped(app))
            raw = json_body({"model": "m", "prompt": "hello"})
            calls: list[grpc.aio.StreamStreamCall] = []  # type: ignore[type-arg]
            picks: list[str] = []
            for _ in range(20):  # each stays open: its request is in flight until it ends
                call = client.stub.Process()
                await call.write(headers(extra={"x-request-id": "same-for-everyone"}))
                await call.write(body(raw))
                picks.append(lb_metadata(await call.read()))
                calls.append(call)
            assert app.inflight.total == 20
            assert Counter(picks) == {s.hostport: 10 for s in servers}
            assert {app.inflight.count(s.hostport) for s in servers} == {10}
            for call in calls:
                await call.done_writing()
            await asyncio.gather(*(_drain(call) for call in calls))
            await until(lambda: app.inflight.total == 0)


async def _drain(call: grpc.aio.StreamStreamCall) -> None:  # type: ignore[type-arg]
    while await call.read() is not grpc.aio.EOF:
        pass
