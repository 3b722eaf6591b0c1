"""`--workers`: a count >= 1 or `auto`; 1 (the default) builds the single-process app."""

from __future__ import annotations

import os

import pytest

from endpoint_picker.cli import build_parser, settings_from_args


def workers(*flags: str) -> int:
    args = build_parser().parse_args(["serve", "--pool-file", "p.yaml", *flags])
    return settings_from_args(args).server.workers


def test_the_default_is_one_process_and_auto_is_the_usable_cores() -> None:
    """No flag: 1; `auto`: the cores this process may run on; a number is taken as is."""
    assert workers() == 1
    assert workers("--workers", "auto") == len(os.sched_getaffinity(0))
    assert workers("--workers", "3") == 3


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_count_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Zero, negative or not a number: one line naming the flag, exit 2."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--pool-file", "p.yaml", "--workers", value])
    assert exited.value.code == 2
    assert "argument --workers: " in capsys.readouterr().err
