"""Prefix and session affinity through the real ext_proc server, with fake model servers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.integration.test_informed_scheduling import settings_for
from tests.support.extproc import (
    FakeClock,
    all_scraped_at,
    body,
    completion,
    headers,
    json_body,
    lb_metadata,
    response_body,
    response_headers,
    wait_for_metrics,
)
from tests.support.extproc import running_app as _running_app
from tests.support.model_servers import FakeModelServer, fake_model_servers, vllm_metrics

from endpoint_picker.app import App
from endpoint_picker.scheduling.plugins.session import token_endpoint

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: bounded-load-filter
- type: prefix-cache-scorer
- type: session-affinity-scorer
- type: inflight-load-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: bounded-load-filter
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: session-affinity-scorer
    weight: 5
  - pluginRef: inflight-load-scorer
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
ADDRS = ["127.0.2.2", "127.0.2.3", "127.0.2.4"]
SYSTEM = "You are a helpful assistant who answers in haiku. " * 40  # about 2 KB


@contextlib.asynccontextmanager
async def affinity_app(tmp_path: Path) -> AsyncIterator[tuple[App, Any, list[FakeModelServer]]]:
    """Three fake model servers, the EPP with CONFIG in front, every endpoint scraped once."""
    clock = FakeClock()
    async with fake_model_servers(ADDRS) as servers:
        settings = settings_for(tmp_path, servers, CONFIG)
        async with _running_app(settings, clock=clock) as (app, client):
            await wait_for_metrics(app, all_scraped_at(clock))
            yield app, client, servers


async def complete(
    client, prompt: str, extra: dict[str, str] | None = None
) -> tuple[str, dict[str, str]]:  # type: ignore[no-untyped-def]
    """One request through its whole lifecycle; the endpoint and the response headers set."""
    out = await client.exchange(
        [*completion("crit", prompt, extra=extra), response_headers(), response_body(b"{}")]
    )
    set_headers = {
        h.header.key: h.header.raw_value.decode()
        for r in out
        if r.WhichOneof("response") == "response_headers"
        for h in r.response_headers.response.header_mutation.set_headers
    }
    return lb_metadata(out[0]), set_headers


async def test_a_repeated_prefix_lands_on_the_same_endpoint(tmp_path: Path) -> None:
    """Requests sharing a long system prompt follow the first one's endpoint."""
    async with affinity_app(tmp_path) as (app, client, _servers):
        picks = [(await complete(client, f"{SYSTEM} question {i}"))[0] for i in range(12)]
        exported = app.metrics.render().decode()
    assert len(set(picks)) == 1
    sizes = [
        line
        for line in exported.splitlines()
        if line.startswith("inference_extension_prefix_indexer_size")
    ]
    assert float(sizes[0].split()[-1]) > 0
    assert 'inference_extension_prefix_indexer_hit_ratio_bucket{le="1.0"} 12.0' in exported


async def test_a_busy_holder_of_the_prefix_is_passed_over(tmp_path: Path) -> None:
    """When the prefix's endpoint is past the load bound, the prefix gets a second home."""
    async with affinity_app(tmp_path) as (app, client, servers):
        holder, _ = await complete(client, f"{SYSTEM} first")
        busy = next(s for s in servers if s.hostport == holder)
        busy.metrics_text = vllm_metrics(waiting=12)

        def busy_seen(app: App) -> bool:
            states = {s.hostport: s for s in app.datastore.endpoint_states()}
            return states[holder].metrics.waiting_queue_size == 12

        await wait_for_metrics(app, busy_seen)
        elsewhere = [(await complete(client, f"{SYSTEM} next {i}"))[0] for i in range(6)]
    assert holder not in elsewhere
    assert len(set(elsewhere)) == 1  # the second home keeps the prefix


async def test_a_returned_session_token_is_honoured(tmp_path: Path) -> None:
    """The response names its endpoint in x-session-token; sending it back goes there."""
    async with affinity_app(tmp_path) as (_app, client, _servers):
        first, set_headers = await complete(client, "hello")
        token = set_headers["x-session-token"]
        assert token_endpoint(token) == first
        again = {
            (await complete(client, f"unrelated {i}", {"x-session-token": token}))[0]
            for i in range(8)
        }
    assert again == {first}


async def test_a_session_id_sticks_to_its_endpoint(tmp_path: Path) -> None:
    """Requests with the same x-session-id keep to the endpoint the session first went to."""
    async with affinity_app(tmp_path) as (app, client, _servers):
        picks = {
            (await complete(client, f"turn {i}", {"x-session-id": "conv-7"}))[0] for i in range(8)
        }
        assert app.datastore.loaded
    assert len(picks) == 1


async def test_streams_that_die_leave_no_inflight_count(tmp_path: Path) -> None:
    """Streams closed mid-response (or before routing) leave the in-flight count at zero."""
    async with affinity_app(tmp_path) as (app, client, _servers):
        raw = json_body({"model": "crit", "prompt": "x"})
        await client.exchange([headers(), body(raw), response_headers()])  # no body: dies
        await client.exchange([headers(), body(raw)])  # routed, no response at all
        await client.exchange([headers()])  # never routed
        await complete(client, "done")
        assert app.inflight.total == 0


async def test_a_response_starts_once_at_its_first_body_bytes(tmp_path: Path) -> None:
    """The EPP counts a routed request as started (out of its server's queue) at its first
    non-empty response body chunk, once; a response without a body never starts."""
    async with affinity_app(tmp_path) as (app, client, _servers):
        raw = json_body({"model": "crit", "prompt": "x", "stream": True})
        out = await client.exchange(
            [
                headers(),
                body(raw),
                response_headers("text/event-stream"),
                response_body(b"", end_of_stream=False),  # nothing yet
                response_body(b'data: {"choices": []}\n\n', end_of_stream=False),
                response_body(b"data: [DONE]\n\n"),
            ]
        )
        streamed = lb_metadata(out[0])
        no_body = lb_metadata(
            (await client.exchange([headers(), body(raw), response_headers(status=500)]))[0]
        )
        started = {
            hostport: app.inflight.started_since(hostport, float("-inf"))
            for hostport in {streamed, no_body}
        }
    if streamed == no_body:
        assert started == {streamed: 1}
    else:
        assert started == {streamed: 1, no_body: 0}
