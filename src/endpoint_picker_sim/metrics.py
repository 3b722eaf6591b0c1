"""/metrics in Prometheus text format, with vLLM v1's metric names, types, labels and buckets.

Hand-rendered from precomputed line prefixes: the EPP scrapes every server about 20 times a second
and one process hosts many servers, so a render is a few string joins. ``sim:*`` series are the
simulator's own (how late its step loop runs) and never collide with vLLM's names.
"""

from __future__ import annotations

from collections.abc import Collection

from endpoint_picker_sim.config import EngineConfig
from endpoint_picker_sim.engine import Engine
from endpoint_picker_sim.stats import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    STEP_LAG_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)


def restrict(text: str, names: Collection[str]) -> str:
    """``text`` with only the samples named in ``names``, as prometheus_client's
    ``/metrics?name[]=...`` gives them (vLLM's and SGLang's servers): a family keeps its
    ``# HELP`` and ``# TYPE`` lines when at least one of its samples is kept, a histogram's
    samples are named ``..._bucket``, ``..._sum`` and ``..._count``."""
    wanted = frozenset(names)
    out: list[str] = []
    header: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            if line.startswith("# HELP "):
                header = [line]
            else:
                header.append(line)
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        if line[:end] in wanted:
            out.extend(header)
            header = []
            out.append(line)
    return "".join(out)


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _header(name: str, kind: str, doc: str) -> str:
    # Counters are announced by their _total name, as prometheus_client (so vLLM) writes them.
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class _HistogramLines:
    """Precomputed text for one histogram series; only the numbers change per render."""

    __slots__ = ("buckets", "count", "header", "sum")

    def __init__(self, name: str, doc: str, labels: str, bounds: tuple[float, ...]) -> None:
        self.header = _header(name, "histogram", doc)
        les = [repr(float(b)) for b in bounds] + ["+Inf"]
        self.buckets = [f'{name}_bucket{{{labels},le="{le}"}} ' for le in les]
        self.count = f"{name}_count{{{labels}}} "
        self.sum = f"{name}_sum{{{labels}}} "

    def render(self, hist: Histogram, out: list[str]) -> None:
        out.append(self.header)
        total = 0
        for prefix, n in zip(self.buckets, hist.counts, strict=True):
            total += n
            out.append(f"{prefix}{float(total)!r}\n")
        out.append(f"{self.count}{float(hist.count)!r}\n")
        out.append(f"{self.sum}{hist.sum!r}\n")


# (name, help) of each scalar family, in exposition order; values come from ``_scalars``.
_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    (
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage."
        "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
    ),
)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
)
_SIM_COUNTERS = (
    ("sim:steps", "Simulator: engine steps run."),
    ("sim:step_planned_seconds", "Simulator: planned wall time of all steps."),
    ("sim:step_late_seconds", "Simulator: summed lateness of step completions (wall seconds)."),
    ("sim:step_early_seconds", "Simulator: summed earliness of step completions (wall seconds)."),
    ("sim:step_behind_seconds", "Simulator: lateness given up on (too far behind to catch up)."),
    (
        "sim:prefix_cache_oracle_hits",
        "Simulator: prompt tokens the longest prefix cached on any server of the process would "
        "have hit, counted at admission beside vllm:prefix_cache_hits.",
    ),
)


def _scalar_prefixes(labels: str) -> tuple[list[str], list[str], list[str]]:
    gauges = [f"{_header(n, 'gauge', d)}{n}{{{labels}}} " for n, d in _GAUGES]
    counters = [
        f"{_header(n + '_total', 'counter', d)}{n}_total{{{labels}}} " for n, d in _COUNTERS
    ]
    sim = [f"{_header(n + '_total', 'counter', d)}{n}_total{{{labels}}} " for n, d in _SIM_COUNTERS]
    return gauges, counters, sim


class MetricsRenderer:
    """Renders one engine's /metrics."""

    def __init__(self, model_name: str, config: EngineConfig) -> None:
        labels = f'model_name="{_esc(model_name)}",engine="0"'
        self._gauges, self._counters, self._sim = _scalar_prefixes(labels)
        self._success = [
            f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} '
            for reason in ("stop", "length", "abort")
        ]
        self._success_header = _header(
            "vllm:request_success_total", "counter", "Count of successfully processed requests."
        )
        self._lora_header = _header(
            "vllm:lora_requests_info", "gauge", "Running stats on lora requests."
        )
        self._lora_prefix = f'vllm:lora_requests_info{{max_lora="{config.max_loras}",'
        self._labels = labels
        self._cache_info = (
            _header("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
            + "vllm:cache_config_info{"
            + f'block_size="{config.block_size}",cache_dtype="auto",'
            + 'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
            + f'num_gpu_blocks="{config.num_gpu_blocks}",{labels}}} 1.0\n'
        )
        self._histograms = (
            _HistogramLines(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                labels,
                TTFT_BUCKETS,
            ),
            _HistogramLines(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels,
                ITL_BUCKETS,
            ),
            _HistogramLines(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                labels,
                REQUEST_LATENCY_BUCKETS,
            ),
            _HistogramLines(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                labels,
                REQUEST_LATENCY_BUCKETS,
            ),
        )
        self._lag = _HistogramLines(
            "sim:step_lag_seconds",
            "Simulator: how late each engine step completed against its plan (wall seconds).",
            labels,
            STEP_LAG_BUCKETS,
        )

    def render(self, engine: Engine) -> str:
        """The full exposition text for ``engine`` right now."""
        s = engine.stats
        usage = engine.blocks.usage()
        out: list[str] = []
        gauges = (len(engine.running), len(engine.waiting), usage, usage)
        counters = (s.prefix_queries, s.prefix_hits, s.preemptions, s.prompt_tokens,
                    s.generation_tokens)  # fmt: skip
        for prefix, value in zip(self._gauges, gauges, strict=True):
            out.append(f"{prefix}{float(value)!r}\n")
        for prefix, value in zip(self._counters, counters, strict=True):
            out.append(f"{prefix}{float(value)!r}\n")
        out.append(self._success_header)
        for prefix, value in zip(
            self._success, (0, s.success_length, s.success_abort), strict=True
        ):
            out.append(f"{prefix}{float(value)!r}\n")
        hists = (s.ttft, s.itl, s.e2e, s.queue)
        for lines, hist in zip(self._histograms, hists, strict=True):
            lines.render(hist, out)
        out.append(self._lora_header)
        for (running, waiting), stamp in s.lora_info.items():
            out.append(
                f'{self._lora_prefix}running_lora_adapters="{_esc(running)}",'
                f'waiting_lora_adapters="{_esc(waiting)}",{self._labels}}} {stamp!r}\n'
            )
        out.append(self._cache_info)
        self._lag.render(s.step_lag, out)
        sim = (s.steps, s.step_planned_wall, s.step_late_wall, s.step_early_wall,
               s.step_behind_wall, s.oracle_hits)  # fmt: skip
        for prefix, value in zip(self._sim, sim, strict=True):
            out.append(f"{prefix}{float(value)!r}\n")
        return "".join(out)
