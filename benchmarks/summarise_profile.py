"""Where the EPP's time goes: a py-spy profile (raw/collapsed stacks) summed by part.

Run: .venv/bin/python benchmarks/summarise_profile.py PROFILE.txt [--requests N] [--top 15]

Each sample goes to the part of the innermost frame that is ours (the gRPC servers,
extproc/server.py's servicer loop and extproc/h2grpc.py, count as gRPC: their own samples are
the receive and send calls):
- request path: extproc (but the servicer loop), director, scheduling, flow control, requests;
- scraping:     endpoint_picker.metrics (the model servers' /metrics);
- telemetry:    endpoint_picker.telemetry and prometheus_client (the EPP's own metrics, logs);
- gRPC + asyncio: everything else (grpc.aio's poller thread, its callbacks on the event loop,
                  the selector, the servicer loop's receive and send).
With --requests (the number served while sampling) it also prints microseconds per request,
from py-spy's sample rate.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_FRAME_FILE = re.compile(r"\(([^:()]+)(?::\d+)?\)$")
PARTS = ("request path", "scraping", "telemetry", "gRPC + asyncio")


def part_of(frame: str) -> str | None:
    """The part a frame belongs to, or None when it is not ours (gRPC, asyncio, stdlib)."""
    match = _FRAME_FILE.search(frame)
    path = match.group(1) if match else ""
    if "prometheus_client/" in path:
        return "telemetry"
    if "endpoint_picker/" not in path:
        return None
    module = path.split("endpoint_picker/", 1)[1]
    if module in ("extproc/server.py", "extproc/h2grpc.py"):  # the gRPC servers' own code
        return None
    if module.startswith("metrics/"):
        return "scraping"
    if module.startswith("telemetry/"):
        return "telemetry"
    if module.startswith(("extproc/", "scheduling/", "flowcontrol/")) or module in (
        "director.py",
        "requests.py",
    ):
        return "request path"
    return None


def summarise(lines: list[str]) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(samples per part, samples per innermost frame of the request path)."""
    parts: collections.Counter[str] = collections.Counter()
    hot: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        samples = int(count)
        part = "gRPC + asyncio"
        for frame in reversed(frames):
            found = part_of(frame)
            if found is not None:
                part = found
                if found == "request path":
                    hot[re.sub(r":\d+\)$", ")", frame)] += samples
                break
        parts[part] += samples
    return parts, hot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--requests", type=int, help="requests served while sampling")
    parser.add_argument("--rate", type=int, default=250, help="py-spy's samples per second")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    # split on newlines only: a frame name may hold a character splitlines() breaks on
    parts, hot = summarise(args.profile.read_text().split("\n"))
    total = sum(parts.values())
    for part in PARTS:
        share = parts[part] / total if total else 0.0
        line = f"{part:15s} {share:6.1%}"
        if args.requests:
            line += f"  {parts[part] / args.rate / args.requests * 1e6:6.0f} us/request"
        print(line)
    print("request path, innermost function of ours:")
    for frame, samples in hot.most_common(args.top):
        print(f"  {samples / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
