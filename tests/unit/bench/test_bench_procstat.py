"""``/proc`` readings of a process: CPU, RSS, fds, children, alive or not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from endpoint_picker.bench.model import BenchError
from endpoint_picker.bench.procstat import children, cpu_seconds, is_alive, rss_mib, usage

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]


def test_cpu_seconds_grow_with_work() -> None:
    """Burning 0.2 s of CPU shows in this process's CPU seconds."""
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.15


def test_usage_counts_the_children() -> None:
    """A child's RSS and fds are added to its parent's; ``children`` finds it."""
    alone = usage(os.getpid())
    child = subprocess.Popen(SLEEPER)
    try:
        deadline = time.monotonic() + 5
        while rss_mib(child.pid) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # the interpreter is still loading
        assert child.pid in children(os.getpid())
        together = usage(os.getpid())
        assert together["rss_mib"] >= alone["rss_mib"] + rss_mib(child.pid) * 0.5
        assert together["fds"] > alone["fds"]
    finally:
        child.kill()
        child.wait()


def test_an_exited_process_is_not_alive() -> None:
    """A zombie (exited, not yet reaped) and a reaped pid both read as gone."""
    child = subprocess.Popen(SLEEPER)
    assert is_alive(child.pid)
    child.kill()
    deadline = time.monotonic() + 5
    while is_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not is_alive(child.pid)  # a zombie until waited for
    with pytest.raises(BenchError):
        usage(child.pid)
    child.wait()
    assert not is_alive(child.pid)
