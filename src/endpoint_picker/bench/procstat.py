"""What a process costs, from ``/proc``: CPU seconds, RSS, open file descriptors (Linux only).

The soak samples the EPP with these, and the benchmarks that drive a process on their own
(``benchmarks/``) measure it with them. A process "with its workers" is ``epp serve --workers
N``: the parent and its live children; the CPU of workers already reaped is in the parent's
children times (``cutime``, ``cstime``), which ``usage`` counts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from endpoint_picker.bench.model import BenchError

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``epp serve --workers``'s workers)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def cpu_seconds(pid: int, *, with_children: bool = False) -> float:
    """User + system CPU of ``pid`` so far (and of its live children, if asked)."""
    total = 0
    for each in (pid, *(children(pid) if with_children else ())):
        try:
            fields = _stat(each)
        except OSError:  # a child gone meanwhile
            if each == pid:
                raise
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def rss_mib(pid: int) -> float:
    """The resident set size of ``pid`` (VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"no VmRSS for pid {pid}")


def usage(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and CPU seconds of ``pid`` and its live children together, CPU
    including reaped children; ``BenchError`` if ``pid`` is gone or a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = _stat(pid)
    except OSError as exc:
        raise BenchError(f"pid {pid} is gone: {exc}") from exc
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        raise BenchError(f"pid {pid} exited")
    rss_kib, fds = float(fields["VmRSS"].split()[0]), 0
    ticks = sum(int(v) for v in stat[11:15])  # utime, stime, cutime, cstime
    for each in (pid, *children(pid)):
        with contextlib.suppress(OSError, BenchError):  # a worker that has just exited
            fds += len(os.listdir(f"/proc/{each}/fd"))
            if each != pid:
                rss_kib += rss_mib(each) * 1024
                child = _stat(each)
                ticks += int(child[11]) + int(child[12])
    return {"rss_mib": rss_kib / 1024, "fds": float(fds), "cpu_seconds": ticks / TICK}


def is_alive(pid: int) -> bool:
    """False once ``pid`` has exited (gone, or a zombie not yet reaped)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False
