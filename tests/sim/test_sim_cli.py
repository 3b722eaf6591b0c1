"""``epp sim`` flags (vLLM spellings included), bad-flag handling, and a real process run."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import aiohttp
import pytest

from endpoint_picker_sim.cli import UsageError, build_config, main
from endpoint_picker_sim.cluster import running_servers


def test_defaults_follow_the_profile() -> None:
    """Only --model is required; KV capacity and step costs come from the default profile."""
    sim = build_config(["--model", "m"])
    eng = sim.server.engine
    assert (sim.servers, sim.address, sim.port) == (1, "127.0.0.2", 8000)
    assert (eng.num_gpu_blocks, eng.block_size, eng.max_num_seqs) == (27000, 16, 256)
    assert eng.max_num_batched_tokens == 8192
    assert eng.profile.name == "llama-3.1-8b-h100"
    assert eng.max_model_len == 131072


def test_vllm_spellings_and_lora_module_forms() -> None:
    """--host, --num-gpu-blocks-override; --lora-modules as name=path, JSON, spaces or commas."""
    sim = build_config(
        ["--model", "m", "--host", "127.0.0.9", "--num-gpu-blocks-override", "100",
         "--lora-modules", "a=/p/a", "b", "--lora-modules", "c,d=/p/d",
         "--lora-modules", '{"name": "e", "path": "/p/e"}']
    )  # fmt: skip
    assert sim.address == "127.0.0.9"
    assert sim.server.engine.num_gpu_blocks == 100
    assert sim.server.engine.max_model_len == 1600  # capped by the KV cache, as vLLM would
    mods = [(m.name, m.path) for m in sim.server.lora_modules]
    assert mods == [
        ("a", "/p/a"),
        ("b", "/adapters/b"),
        ("c", "/adapters/c"),
        ("d", "/p/d"),
        ("e", "/p/e"),
    ]


def test_kv_events_config_is_vllms_json_and_the_port_a_shorthand() -> None:
    """--kv-events-config takes vLLM's KVEventsConfig fields (publisher defaulting to zmq when
    enabled); disabled or the null publisher means no events; --kv-events-port PORT publishes on
    every server's address with replay on PORT+1 and llm-d's topic."""
    spec = (
        '{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:5557", "topic": "kv@x@m", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 7, "hwm": 9, "max_queue_size": 3}'
    )
    kv = build_config(["--model", "m", "--kv-events-config", spec]).server.kv_events
    assert kv is not None
    assert (kv.endpoint, kv.replay_endpoint, kv.topic) == ("tcp://10.0.0.1:5557",
                                                          "tcp://*:5558", "kv@x@m")  # fmt: skip
    assert (kv.buffer_steps, kv.hwm, kv.max_queue_size, kv.wire) == (7, 9, 3, "current")
    for off in ('{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, '
                '"publisher": "null"}', "{}"):  # fmt: skip
        assert build_config(["--model", "m", "--kv-events-config", off]).server.kv_events is None
    short = build_config(["--model", "m", "--kv-events-port", "6000", "--kv-events-wire",
                          "legacy"]).server.kv_events  # fmt: skip
    assert short is not None
    assert (short.endpoint, short.replay_endpoint) == ("tcp://*:6000", "tcp://*:6001")
    assert (short.topic, short.wire) == ("kv@${POD_IP}@m", "legacy")
    assert build_config(["--model", "m"]).server.kv_events is None


def test_profile_coefficients_can_be_overridden() -> None:
    """Each step-time coefficient has its own flag."""
    sim = build_config(["--model", "m", "--prefill-us-per-token", "10", "--step-base-us", "0"])
    profile = sim.server.engine.profile
    assert (profile.prefill_us_per_token, profile.base_us) == (10.0, 0.0)
    assert profile.prefill_floor_us == 5680.0


def test_server_speeds_default_to_one_and_go_to_each_server() -> None:
    """--server-speeds gives server i its own factor; without it every server runs at 1.0."""
    assert build_config(["--model", "m", "--servers", "3"]).speeds == (1.0, 1.0, 1.0)
    sim = build_config(["--model", "m", "--servers", "3", "--server-speeds", "1, 2,0.5"])
    assert sim.speeds == (1.0, 2.0, 0.5)
    assert [sim.server_config(i).engine.speed for i in range(3)] == [1.0, 2.0, 0.5]
    assert sim.server_config(2).engine.profile == sim.server.engine.profile


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "m", "--servers", "0"],
        ["--model", "m", "--failure-rate", "2"],
        ["--model", "m", "--failure-codes", "abc"],
        ["--model", "m", "--profile", "nope"],
        ["--model", "m", "--max-model-len", "999999999"],
        ["--model", "m", "--bogus"],
        ["--model", "m", "--address", "not-an-ip"],
        ["--model", "m", "--servers", "3", "--server-speeds", "1,0.5"],
        ["--model", "m", "--servers", "2", "--server-speeds", "1,0"],
        ["--model", "m", "--servers", "2", "--server-speeds", "1,-1"],
        ["--model", "m", "--servers", "2", "--server-speeds", "1,inf"],
        ["--model", "m", "--servers", "2", "--server-speeds", "1,nan"],
        ["--model", "m", "--servers", "2", "--server-speeds", "1,fast"],
        ["--model", "m", "--kv-events-config", "{not json"],
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true, "x": 1}'],
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'],
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": 1}'],
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true, '
         '"publisher": "kafka"}'],
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true, '
         '"endpoint": "udp://x:1"}'],
        ["--model", "m", "--kv-events-port", "5557", "--kv-events-config", "{}"],
        ["--model", "m", "--kv-events-port", "70000"],
        ["--model", "m", "--kv-events-wire", "v2"],
        ["--model", "m", "--tokenizer", "/nonexistent/tokenizer.json"],
    ],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad command line prints exactly one error line and returns 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("epp sim: error: ")
    with pytest.raises(UsageError):
        build_config(argv)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def test_several_servers_share_one_loop_on_consecutive_addresses() -> None:
    """--servers 3 listens on 127.0.0.5-7, same port, each with its own engine."""
    port = _free_port("127.0.0.5")
    sim = build_config(["--model", "m", "--servers", "3", "--address", "127.0.0.5",
                        "--port", str(port), "--time-scale", "50"])  # fmt: skip
    async with running_servers(sim) as servers, aiohttp.ClientSession() as http:
        assert [s.url for s in servers] == [f"http://127.0.0.{i}:{port}" for i in (5, 6, 7)]
        for server in servers:
            async with http.post(f"{server.url}/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 200
        assert [s.engine.stats.generation_tokens for s in servers] == [16, 16, 16]
        assert len({id(s.engine) for s in servers}) == 3


async def test_a_half_speed_server_in_a_fleet_answers_twice_as_slowly() -> None:
    """--server-speeds 1,0.5: the same request costs the second server twice the GPU time."""
    port = _free_port("127.0.0.5")
    sim = build_config(["--model", "m", "--servers", "2", "--address", "127.0.0.5",
                        "--port", str(port), "--time-scale", "2",
                        "--server-speeds", "1,0.5"])  # fmt: skip
    body = {"prompt": "word " * 2000, "max_tokens": 8}
    async with running_servers(sim) as servers, aiohttp.ClientSession() as http:
        for server in servers:
            async with http.post(f"{server.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        # Simulated seconds: steps are committed at their planned end, so no timer noise.
        fast, slow = (s.engine.stats.e2e.sum for s in servers)
    assert [s.engine.stats.e2e.count for s in servers] == [1, 1]
    assert slow == pytest.approx(2 * fast, rel=0.1)


async def test_process_logs_each_server_and_stops_on_sigterm() -> None:
    """``python -m endpoint_picker_sim`` logs one line per server and exits 0 on SIGTERM."""
    port = _free_port("127.0.0.8")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "endpoint_picker_sim", "--model", "m", "--servers", "2",
        "--address", "127.0.0.8", "--port", str(port),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    lines = [await asyncio.wait_for(proc.stderr.readline(), 20) for _ in range(2)]
    assert b"127.0.0.8" in lines[0]
    assert b"127.0.0.9" in lines[1]
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.9:{port}/health") as resp,
    ):
        assert resp.status == 200
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    rest = await proc.stderr.read()
    assert b"Traceback" not in rest
