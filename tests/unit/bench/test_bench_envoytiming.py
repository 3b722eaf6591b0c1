"""Envoy's access log as the bench reads it: the config it adds, the lines it parses, the table."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.unit.bench.builders import result, steady

from endpoint_picker import envoy_config
from endpoint_picker.bench import envoytiming
from endpoint_picker.bench.model import INDEX_HEADER, RouterTiming
from endpoint_picker.bench.report import load_results, tables, write_results


def test_every_connection_manager_gets_the_access_log(tmp_path: Path) -> None:
    """The rendered reference config keeps its filters and gains one file access log whose
    format names the client's index header."""
    text = envoy_config.render("reference", listen_port=8081, admin_port=9901, epp_port=9002)
    config = yaml.safe_load(envoytiming.with_access_log(text, tmp_path / "access.log"))
    managers = [
        f["typed_config"]
        for listener in config["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for f in chain["filters"]
        if f["name"] == "envoy.filters.network.http_connection_manager"
    ]
    assert managers
    for manager in managers:
        (log,) = manager["access_log"]
        assert log["typed_config"]["path"] == str(tmp_path / "access.log")
        assert (
            INDEX_HEADER.upper()
            in log["typed_config"]["log_format"]["text_format_source"]["inline_string"]
        )
        assert any(f["name"] == "envoy.filters.http.ext_proc" for f in manager["http_filters"])


def test_lines_are_read_by_index(tmp_path: Path) -> None:
    """Only the asked-for indexes count; an upstream start before the request's end counts 0;
    a request that never went upstream, a foreign line and garbage are left out."""
    log = tmp_path / "access.log"
    log.write_text(
        "1 1000 200 1500 127.0.0.2:8000\n"  # asked: 1 ms to upstream, 0.2 ms to the client
        "2 - 100 30\n"  # asked: upstream began while the body still arrived -> 0
        "3 - - -\n"  # asked: never went upstream (a 429 from the EPP)
        "4 3000 300 3500\n"  # asked
        "5 9000 900 9500\n"  # not asked (a warm-up request)
        "- 10 10 10\n"  # no index header (a health check)
        "garbage\n"
    )
    timing = envoytiming.read_timing(log, [1, 2, 3, 4])
    assert timing is not None
    assert timing.requests == 3
    assert timing.to_upstream == pytest.approx((0.001, 0.0026, 0.00296))  # of 0, 1, 3 ms
    assert timing.to_client[0] == pytest.approx(0.0002)
    assert envoytiming.read_timing(log, [3]) is None
    assert envoytiming.read_timing(tmp_path / "missing.log", [1]) is None


def test_timing_round_trips_and_is_tabled(tmp_path: Path) -> None:
    """A result's router timing survives results.json and gets its own table, in ms."""
    timing = RouterTiming(3, (0.001, 0.002, 0.003), (0.0002, 0.0004, 0.0006))
    results = [result(steady(), target="epp", router=timing), result(steady(), target="sglang")]
    write_results(tmp_path, results, {})
    loaded, _ = load_results(tmp_path)
    assert loaded == results
    text = tables(loaded, {})
    assert "| epp | 10 | 3 | 1.00 / 2.00 / 3.00 | 0.20 / 0.40 / 0.60 |" in text
    assert "| sglang | 10 |" not in text.split("What the router added")[1]


def test_the_server_of_each_request_is_read(tmp_path: Path) -> None:
    """The line's last field names the server that served the request; none without one."""
    log = tmp_path / "access.log"
    log.write_text("1 1000 200 1500 127.0.0.2:8000\n2 - - - -\n3 10 10 10\n- 1 1 1 x:1\n")
    assert envoytiming.upstream_hosts(log) == {1: "127.0.0.2:8000"}
    assert envoytiming.upstream_hosts(tmp_path / "missing.log") == {}
