"""`--workers`: a count >= 1 or `auto`; 1 (the default) builds the single-process app."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from endpoint_picker.cli import build_parser, settings_from_args
from endpoint_picker.flags.values import cgroup_cpus as _cgroup_cpus


def workers(*flags: str) -> int:
    args = build_parser().parse_args(["serve", "--pool-file", "p.yaml", *flags])
    return settings_from_args(args).server.workers


def test_the_default_is_one_process_and_auto_is_the_usable_cores() -> None:
    """No flag: 1; `auto`: the cores this process may run on; a number is taken as is."""
    assert workers() == 1
    assert workers("--workers", "auto") == min(len(os.sched_getaffinity(0)), _cgroup_cpus())
    assert workers("--workers", "3") == 3


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_count_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Zero, negative or not a number: one line naming the flag, exit 2."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--pool-file", "p.yaml", "--workers", value])
    assert exited.value.code == 2
    assert "argument --workers: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "cpus"),
    [
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),
        ("50000 100000\n", 1),
        ("max 100000\n", 1 << 16),
    ],
)
def test_auto_is_capped_by_the_cgroup_quota(tmp_path: Path, content: str, cpus: int) -> None:
    """A pod limited to 1.5 CPUs runs 2 workers, not one per core of the node."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(content)
    assert _cgroup_cpus(str(cpu_max)) == cpus
    assert _cgroup_cpus(str(tmp_path / "missing")) == 1 << 16
