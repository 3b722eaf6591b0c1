"""What one ``epp bench soak`` is asked to do, and the limits its steps and verdicts use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

AFTER_LOAD = 15.0  # seconds between the last request's end and the final sample
LAG_SHARE, LAG_FLOOR = 0.05, 0.002  # the schedule: mean send lag vs the mean gap
STEP_LATE_LIMIT = 0.05  # the fleet's clock: late / planned step time
OK_SHARE = 0.99
DEFAULT_RAMP = (
    20,
    40,
    60,
    80,
    100,
    125,
    150,
    175,
    200,
    250,
    300,
    350,
    400,
    450,
    500,
    600,
    700,
    800,
)


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """The command line, parsed and checked (``epp bench soak --help`` says what each means)."""

    out: Path
    command: str  # the command line, for soak.json
    rate: float | None = None  # None: half of what the ramp finds
    find_max: bool = False
    duration: float = 1800.0
    warmup: float = 300.0
    sample_interval: float = 10.0
    vanish: float = 0.05
    ramp: tuple[float, ...] = tuple(float(r) for r in DEFAULT_RAMP)
    step: float = 30.0
    ttft_p90: float = 0.5
    seed: int = 1
    ext_proc_graceful_close: bool = False
    worker_max_requests: int = 0
    epp_env: tuple[tuple[str, str], ...] = ()
