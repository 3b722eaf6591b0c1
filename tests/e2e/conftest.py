"""Module-scoped e2e fixtures: backends, and one EPP + Envoy per shipped variant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from endpoint_picker.app import App
from endpoint_picker.envoy_config import VARIANTS
from tests.e2e.harness import (
    Backend,
    Envoy,
    add_subset_hint_filter,
    backends,
    e2e_pool,
    running_envoy,
    running_epp,
)

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@dataclass
class Stack:
    """One variant's Envoy in front of the in-process EPP and the backends."""

    variant: str
    envoy: Envoy
    epp: App
    backends: list[Backend]

    def backend(self, hostport: str) -> Backend:
        return next(b for b in self.backends if b.hostport == hostport)

    def all_received(self) -> list[tuple[Backend, int]]:
        return [(b, len(b.received)) for b in self.backends if b.received]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool_backends() -> AsyncIterator[list[Backend]]:
    async with backends(ADDRESSES) as servers:
        yield servers


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=VARIANTS)
async def stack(
    request: pytest.FixtureRequest,
    pool_backends: list[Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Stack]:
    variant: str = request.param
    tmp = tmp_path_factory.mktemp(variant)
    fallbacks = 1 if variant == "fallback" else 0
    async with (
        running_epp(tmp, e2e_pool(pool_backends), fallbacks=fallbacks) as epp,
        running_envoy(
            tmp,
            variant,
            epp_port=epp.ports.ext_proc,
            endpoints=[b.hostport for b in pool_backends],
            tweak=add_subset_hint_filter,
            max_request_bytes=1024 * 1024,
        ) as envoy,
    ):
        yield Stack(variant, envoy, epp, pool_backends)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with _client_session() as client:
        yield client


@pytest_asyncio.fixture
async def own_session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session on the test's own event loop, for the tests that build their own stack
    rather than share the module's."""
    async with _client_session() as client:
        yield client


def _client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))


@pytest.fixture(autouse=True)
def _fresh_records(request: pytest.FixtureRequest) -> None:
    """Each test sees only what its own requests delivered to the backends."""
    servers: list[Backend] = []
    if "pool_backends" in request.fixturenames:
        servers = request.getfixturevalue("pool_backends")
    for server in servers:
        server.received.clear()
