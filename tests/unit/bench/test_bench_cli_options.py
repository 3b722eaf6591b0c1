"""``epp bench run`` fleet options on the command line, checked before anything starts."""

from __future__ import annotations

import pytest

from endpoint_picker.bench.cli import EXIT_USAGE, build_parser, main

RUN = ["run", "--workload", "shared-prefix", "--stack", "rr", "--rate", "1"]


def _exit_code(argv: list[str]) -> int:
    """``main``'s code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(str(exc.code))


def test_server_speeds_parse_to_one_factor_each() -> None:
    """--server-speeds 1,1,1,0.5 becomes a tuple of floats; without it the fleet default stays."""
    args = build_parser().parse_args([*RUN, "--server-speeds", "1,1,1,0.5"])
    assert args.server_speeds == (1.0, 1.0, 1.0, 0.5)
    assert build_parser().parse_args(RUN).server_speeds is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--server-speeds", "1,1,0.5"], "--server-speeds has 3 factor(s) for 4 server(s)"),
        (["--servers", "2", "--server-speeds", "1,0"], "positive and finite"),
        (["--servers", "2", "--server-speeds", "1,-2"], "positive and finite"),
        (["--servers", "2", "--server-speeds", "1,nan"], "positive and finite"),
        (["--servers", "2", "--server-speeds", "1,slow"], "not a list of numbers"),
    ],
)
def test_bad_server_speeds_are_a_usage_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong count or a factor that is not a positive number: one line, exit 2, nothing run."""
    assert _exit_code([*RUN, *flags]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_disruptions_parse_to_kind_seconds_and_server() -> None:
    """--disrupt restart@30 and reset@12.5:2 become (kind, seconds, server), server 0 by default."""
    args = build_parser().parse_args([*RUN, "--disrupt", "restart@30", "--disrupt", "reset@12.5:2"])
    assert args.disrupt == [("restart", 30.0, 0), ("reset", 12.5, 2)]


@pytest.mark.parametrize(
    "flags",
    [
        ["--disrupt", "reboot@3"],
        ["--disrupt", "reset"],
        ["--disrupt", "reset@-1"],
        ["--disrupt", "reset@soon"],
        ["--disrupt", "reset@3:x"],
        ["--servers", "2", "--disrupt", "restart@3:2"],
    ],
)
def test_bad_disruptions_are_a_usage_error(flags: list[str]) -> None:
    """An unknown kind, a missing or negative time, a server beyond --servers: exit 2."""
    assert _exit_code([*RUN, *flags]) == EXIT_USAGE
