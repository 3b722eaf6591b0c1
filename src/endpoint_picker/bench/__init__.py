"""``epp bench``: routing quality measured on a simulated fleet, side by side with other routers.

Modules, in the order a run uses them:

- ``model``: the shared value types (a request to send, what came back, a target's result).
- ``workloads``: seeded request streams (shared-prefix, hot-prefix, chat, ...) and arrivals.
- ``stacks``: a fresh local stack per strategy (simulated fleet, Envoy, and the router).
- ``client``: the open-loop streaming client that sends a workload and times every request.
- ``fleetwatch``: scrapes the fleet during a run (per-server load, prefix-cache hits, queues,
  the simulator's clock keeping).
- ``progress``: the client's progress: a bar on a terminal, a line every 30 s elsewhere.
- ``stats``: percentiles, per-target summaries and the validity check.
- ``report``: ``results.json``, the markdown table and the PNG plots.
- ``run``: the orchestration behind ``epp bench run``; ``cli``: the command line.

Needs the ``bench`` extra (``pip install -e '.[bench]'``); the EPP itself never imports this.
"""
