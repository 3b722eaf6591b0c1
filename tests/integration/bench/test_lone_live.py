"""The benchmarks' harness pieces for real: a lone ``epp serve`` answering one ext_proc
exchange, and one Envoy standing in for a fleet of model-server endpoints."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from endpoint_picker.bench.fleetenvoy import COMPLETION, backend_fleet, default_envoy
from endpoint_picker.bench.lone import LONE_ADDRESSES, body, headers, lone_epp
from endpoint_picker.bench.processes import free_ports

PAGE = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="m"} 3.0\n'
    "# TYPE vllm:unrelated_total counter\n"
    'vllm:unrelated_total{model_name="m"} 1.0\n'
)


async def test_lone_epp_routes_one_request(tmp_path: Path) -> None:
    """``lone_epp`` starts ``epp serve`` on its pool; the messages route to one of its pods."""
    port, health, metrics = free_ports(3, "127.0.0.1")
    async with (
        lone_epp(tmp_path, port, "h2", side_ports=(health, metrics)) as process,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        await asyncio.wait_for(channel.channel_ready(), 20)
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        await call.write(body(orjson.dumps({"model": "base", "prompt": "hello"})))
        reply = await asyncio.wait_for(call.read(), 10)
        await call.done_writing()
        call.cancel()
    assert process.returncode is not None  # stopped on exit
    mutation = reply.request_headers.response.header_mutation
    routed = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert routed["x-gateway-destination-endpoint"].rsplit(":", 1)[0] in LONE_ADDRESSES


def test_backend_fleet_answers_metrics_and_completions(tmp_path: Path) -> None:
    """Each endpoint answers ``/metrics`` with the page (filtered by ``name[]`` as vLLM does)
    and anything else with the completion."""
    endpoints = ["127.0.0.71:18000", "127.0.0.72:18000"]
    with backend_fleet(default_envoy(), endpoints, tmp_path, PAGE):
        for endpoint in endpoints:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as reply:
                assert reply.read().decode() == PAGE
            url = f"http://{endpoint}/metrics?name[]=vllm:num_requests_waiting"
            with urllib.request.urlopen(url, timeout=5) as reply:
                filtered = reply.read().decode()
            assert "num_requests_waiting" in filtered
            assert "unrelated" not in filtered
            post = urllib.request.Request(f"http://{endpoint}/v1/completions", data=b"{}")
            with urllib.request.urlopen(post, timeout=5) as reply:
                assert reply.read().decode() == COMPLETION
