"""Analysis: where each prefix group's requests went, per target of an ``epp bench`` report.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/bench_groups.py REPORT_DIR`` (after a run of
a grouped workload: shared-prefix, hot-prefix). It rebuilds the run's plan (the seed and
parameters in ``results.json``) to know each request's group, reads which server served each
request from the front Envoy's access log (``logs/<target>-<n>/envoy-access.log``, Envoy
targets only: the peer routers have none), and prints per target, measured requests only:

- **moved**: of the requests whose group was served before, the share sent to another server
  than the group's previous request (each move may cache the group a second time);
- **servers/group**: the mean number of distinct servers a group's requests went to (groups
  of at least two requests);
- **per server**: requests each server took.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

import orjson

from endpoint_picker.bench import workloads
from endpoint_picker.bench.envoytiming import upstream_hosts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("report", type=Path)
    args = parser.parse_args()
    document = orjson.loads((args.report / "results.json").read_bytes())
    meta = document["meta"]
    folders = sorted((args.report / "logs").glob("*/envoy-access.log"),
                     key=lambda p: p.stat().st_mtime)  # fmt: skip
    envoy_results = [r for r in document["results"] if not r["target"].startswith(("sglang",
                     "vllm-router"))]  # fmt: skip
    for result, log in zip(envoy_results, folders, strict=False):
        plan = workloads.generate(
            meta["workload"], rate=result["rate"], duration=meta["warmup"] + meta["duration"],
            seed=meta["seed"], arrival=meta["arrival"], burstiness=meta["burstiness"],
            params={k: str(v) for k, v in meta["params"].items()},
        )  # fmt: skip
        warm = meta["warmup"]
        hosts = upstream_hosts(log)
        last: dict[str, str] = {}
        seen: defaultdict[str, set[str]] = defaultdict(set)
        repeats = moved = 0
        per_server: Counter[str] = Counter()
        for spec in plan.requests:
            host = hosts.get(spec.index)
            if host is None:
                continue
            previous = last.get(spec.group)
            if spec.at >= warm:
                per_server[host] += 1
                if previous is not None:
                    repeats += 1
                    moved += previous != host
            last[spec.group] = host
            seen[spec.group].add(host)
        multi = [len(s) for g, s in seen.items() if sum(1 for r in plan.requests
                 if r.group == g and r.index in hosts) > 1]  # fmt: skip
        print(
            f"{result['target']} @ {result['rate']:g} ({log.parent.name}): moved "
            f"{moved}/{repeats} ({moved / max(repeats, 1):.0%}), servers/group "
            f"{sum(multi) / max(len(multi), 1):.2f} over {len(multi)} groups, per server "
            + ", ".join(f"{h}: {n}" for h, n in sorted(per_server.items()))
        )


if __name__ == "__main__":
    main()
