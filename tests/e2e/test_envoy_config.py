"""The renderer: every variant renders to a config Envoy accepts; bad inputs fail clearly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from endpoint_picker import envoy_config
from endpoint_picker.envoy_config import VARIANTS, EnvoyConfigError, render
from tests.e2e.harness import ENVOY

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"
POOL = ["127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000", "127.0.0.5:8000"]
# deploy/envoy/<variant>.yaml are rendered with exactly these flags (deploy/envoy/README.md).
EXAMPLE_ARGS = [f"--endpoint={e}" for e in POOL]


async def _validate(path: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(ENVOY),
        "--mode",
        "validate",
        "--disable-hot-restart",
        "-c",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 20)
    return int(process.returncode or 0), out.decode(errors="replace")


@pytest.mark.e2e
@pytest.mark.parametrize("tls", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
async def test_every_variant_renders_to_a_config_envoy_accepts(
    tmp_path: Path, variant: str, tls: bool
) -> None:
    """`envoy --mode validate` accepts each variant, with and without TLS to the EPP."""
    text = render(
        variant,
        epp_address="epp.default.svc.cluster.local" if tls else "10.0.0.9",
        epp_tls=tls,
        endpoints=["10.0.0.5:8000", "[fd00::6]:8000"],
        failure_mode_allow=not tls,
        message_timeout=0.25,
    )
    path = tmp_path / f"{variant}.yaml"
    path.write_text(text)
    code, out = await _validate(path)
    assert code == 0, out
    config = yaml.safe_load(text)
    (epp,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "endpoint_picker"]
    assert epp["type"] == ("STRICT_DNS" if tls else "STATIC")
    assert ("transport_socket" in epp) is tls


@pytest.mark.e2e
@pytest.mark.parametrize("variant", VARIANTS)
async def test_the_shipped_examples_are_current_and_valid(variant: str, tmp_path: Path) -> None:
    """deploy/envoy/<variant>.yaml is what the renderer gives today, and Envoy accepts it."""
    out = tmp_path / "out.yaml"
    assert envoy_config.main(["--variant", variant, "--output", str(out), *EXAMPLE_ARGS]) == 0
    shipped = DEPLOY / f"{variant}.yaml"
    assert shipped.read_text() == out.read_text(), f"re-render {shipped} (deploy/envoy/README.md)"
    code, text = await _validate(shipped)
    assert code == 0, text


def test_the_filter_chain_strips_client_headers_before_the_epp() -> None:
    """In every variant header_mutation (prefix removal) runs first, then buffer, ext_proc."""
    for variant in VARIANTS:
        config = yaml.safe_load(render(variant, endpoints=POOL))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = hcm["typed_config"]["http_filters"]
        assert [f["name"].rsplit(".", 1)[1] for f in filters] == [
            "header_mutation",
            "buffer",
            "ext_proc",
            "router",
        ]
        mutation = filters[0]["typed_config"]["mutations"]["request_mutations"][0]
        assert mutation["remove_on_match"]["key_matcher"] == {
            "prefix": "x-gateway-destination-endpoint"
        }
        ext_proc = filters[2]["typed_config"]
        assert ext_proc["failure_mode_allow"] is False
        route = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        assert route["timeout"] == "0s"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "nope"}, "unknown variant"),
        ({"variant": "fallback"}, "needs the pool's endpoints"),
        ({"variant": "fallback", "endpoints": ["pod-a:8000"]}, "must be ip:port"),
        ({"variant": "fallback", "endpoints": ["10.0.0.1:99999"]}, "port in 1..65535"),
        ({"variant": "reference", "listen_port": 0}, "listen_port"),
        ({"variant": "reference", "epp_address": "a b"}, "not an IP address or host name"),
        ({"variant": "reference", "max_request_bytes": 0}, "max_request_bytes"),
        ({"variant": "reference", "message_timeout": 0}, "message_timeout"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(
    kwargs: dict[str, object], message: str
) -> None:
    """Each invalid input raises EnvoyConfigError naming what is wrong."""
    variant = str(kwargs.pop("variant"))
    with pytest.raises(EnvoyConfigError, match=message):
        render(variant, **kwargs)  # type: ignore[arg-type]


def test_main_prints_yaml_and_exits_2_on_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI entry prints the config to stdout, or one error line and exit code 2."""
    assert envoy_config.main(["--variant", "buffered", "--epp-tls", "false"]) == 0
    printed = capsys.readouterr().out
    assert "request_body_mode: BUFFERED" in printed
    assert "transport_socket:\n      name: envoy.transport_sockets.tls" not in printed
    assert envoy_config.main(["--variant", "fallback"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epp envoy-config: error:")
    assert err.count("\n") == 1


def test_multi_line_values_are_indented_to_their_placeholder() -> None:
    """A block placeholder alone on its line gets every line at the placeholder's column."""
    text = envoy_config.substitute("a:\n  ${block}\nb: ${x}\n", {"block": "c: 1\nd: 2", "x": "3"})
    assert yaml.safe_load(text) == {"a": {"c": 1, "d": 2}, "b": 3}


@pytest.mark.parametrize("variant", ["reference", "fallback", "buffered"])
def test_graceful_ext_proc_close_is_opt_in(variant: str) -> None:
    """Envoy's graceful-close runtime guard is rendered only when asked for (it stops a native
    leak in grpcio, but crashed Envoy 1.40 once under overload)."""
    key = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
    plain = yaml.safe_load(render(variant, endpoints=["127.0.0.2:8000"]))
    assert "layered_runtime" not in plain
    graceful = yaml.safe_load(
        render(variant, endpoints=["127.0.0.2:8000"], ext_proc_graceful_close=True)
    )
    assert graceful["layered_runtime"]["layers"][0]["static_layer"] == {key: True}
    del graceful["layered_runtime"]
    assert graceful == plain
