"""When a workload's requests (or chat sessions) arrive: seeded, open-loop arrival processes.

Three kinds, all with mean rate ``rate`` per second:

- ``poisson`` (the default): exponential gaps, what many independent users produce.
- ``constant``: one arrival every ``1 / rate`` seconds from 0, the least bursty load there is.
- ``bursty``: Gamma-distributed gaps with shape ``burstiness`` and scale ``1 / (rate *
  burstiness)``, so the mean gap stays ``1 / rate`` while the squared coefficient of variation
  of the gaps is ``1 / burstiness``: 1 is Poisson, below 1 arrivals clump into bursts separated
  by lulls (0.25 doubles the gaps' standard deviation), above 1 they are smoother than Poisson.
  This is the ``--burstiness`` of vLLM's ``benchmark_serving``, so figures compare.

Times are drawn from a caller's ``random.Random`` so a seed fixes them; nothing here reads the
global random state.
"""

from __future__ import annotations

import math
import random

from endpoint_picker.bench.model import BenchError

ARRIVALS: dict[str, str] = {
    "poisson": "exponential gaps (independent users)",
    "constant": "one request every 1/rate seconds",
    "bursty": "Gamma gaps, shape = burstiness (1 = Poisson, < 1 burstier); mean rate kept",
}


def check_arrival(kind: str, rate: float, duration: float, burstiness: float) -> None:
    """Raise ``BenchError`` for an arrival process that cannot be generated."""
    if kind not in ARRIVALS:
        raise BenchError(f"unknown arrival {kind!r}; choose from: {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise BenchError(f"rate must be above 0 requests/s, got {rate}")
    if not duration > 0:
        raise BenchError(f"duration must be above 0 s, got {duration}")
    if not burstiness > 0:
        raise BenchError(f"burstiness must be above 0, got {burstiness}")
    if kind != "bursty" and burstiness != 1.0:
        # A silently ignored flag would make two different-looking runs identical.
        raise BenchError(f"burstiness applies to --arrival bursty only (arrival is {kind!r})")


def arrival_times(
    kind: str,
    rate: float,
    duration: float,
    rng: random.Random,
    burstiness: float = 1.0,
    start: float = 0.0,
) -> list[float]:
    """Ascending arrival times in ``[start, start + duration)``, at ``rate`` per second on average.

    A run starts with an arrival at ``start`` only for ``constant``; the random kinds begin with
    a gap, as a process already under way does.
    """
    check_arrival(kind, rate, duration, burstiness)
    end = start + duration
    if kind == "constant":
        count = math.ceil(duration * rate) + 1
        return [t for t in (start + i / rate for i in range(count)) if t < end]
    times: list[float] = []
    t = start
    if kind == "poisson":
        expovariate = rng.expovariate
        while True:
            t += expovariate(rate)
            if t >= end:
                return times
            times.append(t)
    gamma = rng.gammavariate
    scale = 1.0 / (rate * burstiness)
    while True:
        t += gamma(burstiness, scale)
        if t >= end:
            return times
        times.append(t)
