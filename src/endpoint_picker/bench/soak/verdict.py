"""The soak's verdicts (does a series grow?) and its report: printed figures, ``samples.csv``,
``soak.json`` and ``soak.png``."""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from endpoint_picker.bench.soak.load import Tally
from endpoint_picker.bench.soak.options import AFTER_LOAD, LAG_FLOOR, LAG_SHARE, SoakOptions


@dataclass(frozen=True, slots=True)
class Rule:
    key: str
    label: str
    floor: float  # the budget's floor, per hour
    back_to_zero: bool = False


RULES = (
    Rule("rss_mib", "RSS MiB", 2.0),
    Rule("fds", "open fds", 4.0),
    Rule("tasks", "event-loop tasks", 10.0),
    Rule("running", "running requests", 5.0, back_to_zero=True),
    Rule("streams", "ext_proc streams", 5.0, back_to_zero=True),
    Rule("buffered_kib", "buffered KiB", 64.0, back_to_zero=True),
)
BUDGET_SHARE = 0.05  # of the value at the end of the warm-up, per hour
IDLE_TASKS_SLACK = 2  # event-loop tasks after the load, over the idle count before it


def judge(samples: Sequence[dict[str, Any]], warmup: float) -> list[dict[str, Any]]:
    """Each rule's verdict over the samples after the warm-up (the module docstring)."""
    window = [s for s in samples if s["phase"] == "load" and s["t"] >= warmup - 0.5]
    after = samples[-1]
    out = []
    for rule in RULES:
        xs = [s["t"] for s in window]
        ys = [float(s[rule.key]) for s in window]
        verdict: dict[str, Any] = {"series": rule.key, "label": rule.label}
        if len(ys) < 3:
            verdict["verdict"] = "too few samples after the warm-up"
            out.append(verdict)
            continue
        fit = statistics.linear_regression(xs, ys)
        residuals = [y - (fit.intercept + fit.slope * x) for x, y in zip(xs, ys, strict=True)]
        mean_x = statistics.fmean(xs)
        spread = sum((x - mean_x) ** 2 for x in xs)
        se = math.sqrt(sum(r * r for r in residuals) / (len(ys) - 2) / spread)
        growth, noise = fit.slope * 3600, 2 * se * 3600
        budget = max(BUDGET_SHARE * ys[0], rule.floor)
        if growth <= budget:
            word = "flat" if noise <= budget else "flat (noise > budget)"
        elif growth - noise > budget:
            word = "GROWING"
        else:
            word = "inconclusive"
        verdict |= {
            "warmup_end": ys[0], "last": ys[-1], "max": max(ys), "growth_per_hour": growth,
            "two_se_per_hour": noise, "budget_per_hour": budget, "verdict": word,
            "after_load": float(after[rule.key]),
        }  # fmt: skip
        if rule.back_to_zero and after[rule.key] != 0:
            verdict["verdict"] = f"{word}; NOT BACK TO 0"
        if rule.key == "tasks":  # idle again: the load's tasks are all gone
            idle = float(samples[0]["tasks"])
            verdict["idle_before"] = idle
            if after["tasks"] > idle + IDLE_TASKS_SLACK:
                verdict["verdict"] = f"{word}; NOT BACK TO IDLE ({idle:.0f} before the load)"
        out.append(verdict)
    return out


def failed(verdicts: Sequence[dict[str, Any]]) -> bool:
    return any("GROWING" in v["verdict"] or "NOT BACK" in v["verdict"] for v in verdicts)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds % 60 == 0 else f"{seconds:g} s"


PANELS = (
    ("rss_mib", "EPP RSS (MiB)"),
    ("fds", "EPP open file descriptors"),
    ("tasks", "EPP event-loop tasks"),
    ("cpu_percent", "EPP CPU (% of a core)"),
    ("running", "running requests (EPP gauge, summed)"),
    ("streams", "open ext_proc streams (EPP)"),
    ("buffered_kib", "buffered request bodies (KiB, EPP)"),
    ("prefix_index", "prefix index entries (EPP)"),
    ("completed_per_s", "completed requests/s (client)"),
    ("ttft_p90_ms", "TTFT p90, streamed (ms, client)"),
)


def plot(
    samples: Sequence[dict[str, Any]], warmup: float, stopped: float, path: Path, title: str
) -> None:
    """A panel per series over time; the warm-up shaded, the end of the load dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 14))
    axes = figure.subplots(len(PANELS) // 2, 2, sharex=True)
    minutes = [s["t"] / 60 for s in samples]
    for ax, (key, name) in zip(axes.flat, PANELS, strict=True):
        ax.plot(minutes, [s[key] for s in samples], marker=".", markersize=4, linewidth=1)
        ax.axvspan(0, warmup / 60, color="0.88", label="warm-up")
        ax.axvline(stopped / 60, color="0.4", linestyle="--", linewidth=1, label="load stops")
        ax.set_title(name, fontsize=10)
        if key != "rss_mib":  # RSS: zoomed in, so that a drift of a few MiB shows
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes since the load started")
    axes[0][0].legend(loc="lower right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=90)


def _fmt(value: float) -> str:
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def report(
    options: SoakOptions,
    rate: float,
    tally: Tally,
    samples: list[dict[str, Any]],
    stopped: float,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    """Print the figures and the verdicts; write the CSV, the JSON and the plot."""
    out = options.out
    verdicts = judge(samples, options.warmup)
    window = [s for s in samples if s["phase"] == "load" and s["t"] >= options.warmup - 0.5]
    print(f"\nsoak: {rate:g} requests/s for {options.duration:g} s, warm-up {options.warmup:g} s")
    print(f"  sent {tally.sent:,}; complete 200s {tally.done:,}; ok share {tally.ok_share():.3%}")
    for (kind, status), n in sorted(tally.outcomes.items()):
        print(f"    {kind:26} {status:16} {n:8,}")
    print(f"  errors: {dict(tally.errors.most_common(8)) or 'none'}")
    lag = tally.lag_sum / max(tally.sent, 1)
    allowed = max(LAG_SHARE / rate, LAG_FLOOR)
    kept = "kept" if lag <= allowed else "NOT KEPT: the EPP saw less than the asked rate"
    print(f"  schedule: mean send lag {lag * 1e3:.2f} ms (max {tally.lag_max * 1e3:.0f} ms, "
          f"allowed {allowed * 1e3:.1f} ms): {kept}")  # fmt: skip
    if window:
        late = statistics.fmean(s["sim_late_percent"] for s in window)
        ttft = statistics.median(s["ttft_p90_ms"] for s in window)
        cpu = statistics.fmean(s["cpu_percent"] for s in window)
        first, last = window[0], window[-1]
        cpu_ms = (
            (last["cpu_seconds"] - first["cpu_seconds"])
            / max(last["completed"] - first["completed"], 1)
            * 1e3
        )
        print(f"  after the warm-up: fleet {late:.1f}% late; TTFT p90 median of windows "
              f"{ttft:.0f} ms; EPP {cpu:.0f}% of a core, {cpu_ms:.2f} ms CPU per complete "
              f"request")  # fmt: skip
    start, after = samples[0], samples[-1]
    print(f"  idle before the load -> {AFTER_LOAD:g} s after it: tasks {start['tasks']:.0f} -> "
          f"{after['tasks']:.0f}, fds {start['fds']:.0f} -> {after['fds']:.0f}, RSS "
          f"{start['rss_mib']:.1f} -> {after['rss_mib']:.1f} MiB")  # fmt: skip
    print(f"\n  {'series':18} {'warm-up end':>11} {'last':>9} {'max':>9} {'growth/h':>10} "
          f"{'+-2SE/h':>9} {'budget/h':>9} {'after':>7}  verdict")  # fmt: skip
    for v in verdicts:
        if "growth_per_hour" not in v:
            print(f"  {v['label']:18} {v['verdict']}")
            continue
        print(f"  {v['label']:18} {_fmt(v['warmup_end']):>11} {_fmt(v['last']):>9} "
              f"{_fmt(v['max']):>9} {_fmt(v['growth_per_hour']):>10} "
              f"{_fmt(v['two_se_per_hour']):>9} {_fmt(v['budget_per_hour']):>9} "
              f"{_fmt(v['after_load']):>7}  {v['verdict']}")  # fmt: skip
    keys = list(samples[0])
    with (out / "samples.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(samples)
    document = {
        "command": options.command,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rate": rate, "duration": options.duration, "warmup": options.warmup,
        "sample_interval": options.sample_interval, "vanish": options.vanish, "seed": options.seed,
        "load_stopped_at": stopped, "sent": tally.sent, "complete": tally.done,
        "outcomes": {f"{k} {s}": n for (k, s), n in sorted(tally.outcomes.items())},
        "errors": dict(tally.errors), "send_lag_mean_ms": lag * 1e3,
        "send_lag_max_ms": tally.lag_max * 1e3, "verdicts": verdicts, "samples": samples,
        **extra,
    }  # fmt: skip
    (out / "soak.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    title = (
        f"EPP soak: {rate:g} requests/s for {_minutes(options.duration)} "
        f"(warm-up {_minutes(options.warmup)} shaded), {time.strftime('%Y-%m-%d')}"
    )
    plot(samples, options.warmup, stopped, out / "soak.png", title)
    print(f"\nwrote {out / 'samples.csv'}, {out / 'soak.json'}, {out / 'soak.png'}")
    return verdicts
