"""What the router adds to each request, as the Envoy in front of it saw it (its access log).

For the targets with Envoy in front (``rr``, ``lr``, ``epp``), Envoy logs two intervals per
request, keyed by the ``x-bench-index`` header the client sends (``INDEX_HEADER``):

- **to upstream**: from the end of the client's request to the start of the upstream request
  (``DS_RX_END`` -> ``US_TX_BEG``). For ``epp`` this is the pick: the request's ext_proc
  messages, the EPP's work and its answer; for round robin it is Envoy's own routing.
- **to client**: from the first byte of the server's response to the first byte sent to the
  client (``US_RX_BEG`` -> ``DS_TX_BEG``): for ``epp``, the response headers' ext_proc round trip.

The server that served it (``%UPSTREAM_HOST%``) ends the line, for analysis
(``upstream_hosts``; ``benchmarks/bench_groups.py`` follows each prefix group's servers).

The client's time to first token includes both, on top of the server's own time. The peer
routers are their own proxies, with no Envoy to ask: they get no figures.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import yaml

from endpoint_picker.bench.model import INDEX_HEADER, RouterTiming
from endpoint_picker.bench.stats import percentile
from endpoint_picker.types import ascii_int

_FORMAT = (
    f"%REQ({INDEX_HEADER.upper()})% %COMMON_DURATION(DS_RX_END:US_TX_BEG:us)% "
    "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% "
    "%UPSTREAM_HOST%\n"
)
FLUSH_MS = 100  # Envoy's access-log flush interval (its default, 10 s, would outlast a run)
_HCM = "envoy.filters.network.http_connection_manager"


def with_access_log(config_text: str, path: Path) -> str:
    """The Envoy config with every HTTP connection manager logging the two intervals to
    ``path``."""
    config = yaml.safe_load(config_text)
    log = {
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"text_format_source": {"inline_string": _FORMAT}},
        },
    }
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                if network_filter["name"] == _HCM:
                    network_filter["typed_config"].setdefault("access_log", []).append(log)
    return str(yaml.safe_dump(config, sort_keys=False))


def read_timing(path: Path, indexes: Collection[int]) -> RouterTiming | None:
    """The intervals of the requests in ``indexes`` (the measured ones), from the log at
    ``path``; None when the log is missing or has none of them. A request that never went
    upstream, or got no response, is left out."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    wanted = set(indexes)
    upstream: list[float] = []
    client: list[float] = []
    for line in lines:
        fields = line.split()
        if len(fields) not in (4, 5) or _micros(fields[0]) not in wanted:
            continue
        after_end, to_client, after_start = (_micros(f) for f in fields[1:4])
        if after_start is None or to_client is None:
            continue  # never went upstream, or no response came back
        # "-" after the end with a time after the start: the upstream request began while the
        # client's body was still arriving (Envoy alone streams it on), so nothing was added
        upstream.append(after_end / 1e6 if after_end is not None else 0.0)
        client.append(to_client / 1e6)
    if not upstream:
        return None
    return RouterTiming(len(upstream), _quantiles(upstream), _quantiles(client))


def upstream_hosts(path: Path) -> dict[int, str]:
    """Each logged request's server (``host:port``), by its index; requests that never went
    upstream are left out."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[int, str] = {}
    for line in lines:
        fields = line.split()
        index = _micros(fields[0]) if len(fields) == 5 else None
        if index is not None and fields[4] != "-":
            out[index] = fields[4]
    return out


def _micros(text: str) -> int | None:
    """An access-log number (an index, or microseconds); None for ``-`` or anything else."""
    return ascii_int(text, 2**63 - 1)


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    return _at(values, 50), _at(values, 90), _at(values, 99)


def _at(values: list[float], q: float) -> float:
    value = percentile(values, q)
    assert value is not None  # values is not empty
    return value


def timing_table(rows: list[tuple[str, float, RouterTiming]]) -> str:
    """A markdown row per (target, rate, timing), in milliseconds."""
    columns = (
        "target", "rate", "requests", "to upstream p50 / p90 / p99 (ms)",
        "to client p50 / p90 / p99 (ms)",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for target, rate, timing in rows:
        cells = (
            target, f"{rate:g}", str(timing.requests), _ms(timing.to_upstream),
            _ms(timing.to_client),
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{v * 1e3:.2f}" for v in values)


__all__ = ["read_timing", "timing_table", "upstream_hosts", "with_access_log"]
