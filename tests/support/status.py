"""A pool with fake vLLM servers for the status page's tests, and the traffic they send."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from endpoint_picker.app import App
from endpoint_picker.settings import MetricsEndpointSettings
from tests.support import extproc
from tests.support.model_servers import FakeModelServer, fake_model_servers, vllm_metrics
from tests.support.pool import model, pod, pool, pool_yaml

# In every prompt the tests send: it must never appear on the page or in its JSON.
PROMPT_MARKER = "quokka-marmalade-7731"
ADDRESSES = ("127.0.7.2", "127.0.7.3", "127.0.7.4")


def pool_text(servers: Sequence[FakeModelServer]) -> str:
    return pool_yaml(
        pool(port=servers[0].port),
        model("food-review", targets={"food-v1": 80, "food-v2": 20}),
        model("base", criticality="Critical"),
        model("batch", criticality="Sheddable"),
        *(pod(f"vllm-{s.address.rsplit('.', 1)[1]}", s.address) for s in servers),
    )


@dataclass
class StatusStack:
    app: App
    client: extproc.Client
    servers: list[FakeModelServer]
    pool_file: Path
    token: str | None = None  # sent as a bearer token by ``status()``

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.app.ports.metrics}"

    async def status(self) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{self.base_url}/api/status",
                headers={"Authorization": f"Bearer {self.token}"} if self.token else {},
            ) as reply,
        ):
            assert reply.status == 200
            result: dict[str, Any] = await reply.json()
            return result

    def set_pool(self, servers: Sequence[FakeModelServer]) -> None:
        """Rewrite the pool file with these servers' pods (the EPP applies it after settling)."""
        self.pool_file.write_text(pool_text(servers))

    async def wait_scraped(self, count: int, within: float = 5.0) -> None:
        """Until ``count`` endpoints have metrics."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while sum(s.metrics.updated_at > 0 for s in self.app.datastore.endpoint_states()) < count:
            assert loop.time() < deadline, "the fake servers were not scraped in time"
            await asyncio.sleep(0.02)

    async def complete(self, model_name: str) -> None:
        """One request answered in full, its prompt carrying the marker."""
        prompt = {"model": model_name, "prompt": f"Rate this: {PROMPT_MARKER}", "max_tokens": 8}
        request = [extproc.headers(), extproc.body(extproc.json_body(prompt))]
        answer = [extproc.response_headers(), extproc.response_body(b"{}")]
        await self.client.exchange([*request, *answer])

    async def refused(self, model_name: str) -> None:
        """A request the EPP answers itself (an unknown model: 404)."""
        prompt = {"model": model_name, "prompt": f"and {PROMPT_MARKER}"}
        await self.client.exchange([extproc.headers(), extproc.body(extproc.json_body(prompt))])


@contextlib.asynccontextmanager
async def status_stack(
    tmp_path: Path, serving: int = 3, metrics_endpoint: MetricsEndpointSettings | None = None
) -> AsyncIterator[StatusStack]:
    """An EPP scraping three fake vLLM servers (distinct queues, one answering 500, so its
    metrics never arrive), its pool the first ``serving`` of them; ``metrics_endpoint``: the
    metrics port's auth and TLS (default: open)."""
    async with fake_model_servers(ADDRESSES) as servers:
        servers[0].metrics_text = vllm_metrics(waiting=2, running=3, kv=0.42, active=["food-v1"])
        servers[1].metrics_text = vllm_metrics(waiting=0, running=2, kv=0.1, active=["food-v2"])
        servers[2].metrics_status = 500
        settings = extproc.make_settings(tmp_path, pool_text(servers[:serving]), scraping=True)
        if metrics_endpoint is not None:
            server = replace(settings.server, metrics_endpoint=metrics_endpoint)
            settings = replace(settings, server=server)
        async with extproc.running_app(settings) as (app, client):
            assert settings.pool.pool_file is not None
            yield StatusStack(app, client, servers, settings.pool.pool_file)
