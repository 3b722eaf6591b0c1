"""``epp bench soak``: steady load through Envoy + EPP + the simulated fleet; nothing may grow.

Run: epp bench soak [--rate R | --find-max] [--duration 1800] [--warmup 300] [--out DIR]
     (no --rate: find the maximum first, then soak at half of it on a fresh stack)

The stack is ``epp bench run --stack epp``'s (``endpoint_picker.bench.stacks``): 4 simulated
H100 servers (``epp sim``, one process, 8 tokens per SSE chunk), ``epp serve`` with the default
scheduler as its own process, and Envoy with the shipped ``reference`` config in front.

The load is open loop (Poisson arrivals at ``--rate``, seeded), a request when it is due
whatever happened to earlier ones. Each request is a completion or a chat completion (50/50)
for the base model or one of two LoRA adapters (80/20); its prompt is one of 16 system prompts
(256 tokens: exactly 4 prefix blocks of the EPP's index) and a unique question of 8-40 tokens
(never a full block, so the prefix index's working set is small and fixed: a soak of that LRU
filling up would be another test), with ``max_tokens`` 16-64: the routing path and the
simulator bound the run, not prefills. ``--vanish`` (5%) of the clients vanish: half close the
connection after the first streamed chunk, half send the whole request and reset the connection
0-30 ms later, before the response headers (usually while the EPP or the server holds it). Of
the others, half stream and half do not. Outcomes are counted by kind and status.

**Maximum** (``--find-max``): on one stack, 30 s steps of the ``--ramp`` rates; a step passes
when the whole bench keeps its schedule and serves: the client's mean send lag (time from due
to the request's first byte) is at most 5% of the mean gap between arrivals (2 ms floor, the
event loop's timer resolution), the simulated fleet's step lateness is under 5% of its planned
step time (its clock kept), at least 99% of the requests that did not vanish got a complete 200,
and the TTFT p90 of the streamed ones is under ``--ttft-p90`` (0.5 s). The maximum is the
highest rate before the first failing step: this 2-core machine's, for the client, Envoy, the
EPP and the fleet together, at the ramp's granularity; not the EPP's alone.

**Sampled** every ``--sample-interval`` (10 s), from the start of the load and once more 15 s
after the last request finished: the EPP process's RSS (``/proc/PID/status`` VmRSS), open file
descriptors (``/proc/PID/fd``) and CPU seconds (``/proc/PID/stat``); from its ``/metrics``:
``inference_extension_event_loop_tasks`` (asyncio tasks alive),
``inference_model_running_requests`` (summed over models),
``inference_extension_ext_proc_streams``, ``inference_extension_buffered_request_bytes`` and
``inference_extension_prefix_indexer_size``; and, per interval, at the client: complete
requests per second, TTFT p50/p90 of the streamed requests, e2e p90, mean send lag, and the
fleet's step lateness. Written to ``--out``: ``samples.csv``, ``soak.json`` (samples, outcomes,
verdicts, the command) and ``soak.png`` (a panel per series over time, the warm-up shaded).

**Verdict**, per series, over the samples after the warm-up (``--warmup``, 300 s) until the
arrivals stop: the value at the end of the warm-up, the last value and the maximum; the
least-squares slope as growth per hour ``G`` with its standard error ``SE``; and a budget per
hour ``B = max(5% of the value at the end of the warm-up, floor)``, floors: RSS 2 MiB, fds 4,
tasks 10, running requests 5, streams 5, buffered 64 KiB. ``flat`` when ``G <= B`` (``flat
(noise > budget)`` when ``2 SE > B`` too: a weak statement, run longer); ``GROWING`` when even
``G - 2 SE > B`` (a trend the noise does not explain); otherwise ``inconclusive`` (a run too
short for its noise: the in-flight gauges follow the Poisson load). The running requests,
streams and buffered bytes must also read 0 in the sample after the load, and the event-loop
tasks at most 2 above their count before it (the idle EPP). CPU is shown, not
judged (this host's speed drifts by tens of percent over minutes).

Exit status: 0 when every judged series is flat or inconclusive and everything returned to
idle; 1 when one grows or did not return; 2 when the stack cannot start or a process of it dies;
143 when SIGTERM or SIGINT stopped it (every process it started is stopped in every case).

Modules: ``options`` (what a soak is asked, the limits), ``load`` (request bodies, the client,
the tally), ``sampler`` (the samples), ``verdict`` (the verdicts and the report), ``run``
(the ramp, the soak, the exit status). Formerly ``benchmarks/bench_soak.py``.
"""
