"""``epp bench``: routing quality measured on a simulated fleet, side by side with other routers.

Modules, in the order a run uses them:

- ``model``: the shared value types (a request to send, what came back, a target's result).
- ``workloads``: seeded request streams (shared-prefix, hot-prefix, chat, ...) and arrivals.
- ``targets``: the ``--stack`` entries parsed and checked, one ``StackSpec`` per target.
- ``stacks``: a fresh local stack per strategy (simulated fleet, Envoy, and the router).
- ``client``: the open-loop streaming client that sends a workload and times every request.
- ``fleetwatch``: scrapes the fleet during a run (per-server load, prefix-cache hits, queues,
  the simulator's clock keeping).
- ``progress``: the client's progress: a bar on a terminal, a line every 30 s elsewhere.
- ``stats``: percentiles, per-target summaries and the validity check.
- ``report``: ``results.json``, the markdown table and the PNG plots.
- ``run``: the orchestration behind ``epp bench run``; ``cli``: the command line.
- ``soak``: ``epp bench soak``, steady load for half an hour and a verdict on what grows.

For the scripts in ``benchmarks/`` that measure the EPP's parts rather than routing quality:
``lone`` (a lone ``epp serve`` and the ext_proc messages Envoy sends), ``fleetenvoy`` (one
Envoy standing in for many model-server endpoints) and ``procstat`` (a process's CPU, RSS
and fds from ``/proc``). Every percentile anywhere is ``stats.percentile``.

Needs the ``bench`` extra (``pip install -e '.[bench]'``); the EPP itself never imports this.
"""
