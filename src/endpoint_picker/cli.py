"""The ``epp`` command: ``serve``, ``validate``, ``sim``, ``bench`` and ``--version``.

``epp serve``'s flags are declared once, in ``endpoint_picker.flags`` (which builds the
parser's arguments, the ``Settings`` and docs/flags.md). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from endpoint_picker import __version__
from endpoint_picker.errors import ConfigError
from endpoint_picker.flags import serve as serve_flags
from endpoint_picker.flags.serve import settings_from_args
from endpoint_picker.flags.spec import add_arguments, add_groups
from endpoint_picker.settings import Settings
from endpoint_picker.telemetry.logs import configure_logging

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one clear line (and exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epp", description="Endpoint Picker for the Gateway API Inference Extension"
    )
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    serve = sub.add_parser(
        "serve",
        help="serve ext_proc for Envoy",
        description="Every flag, its default and meaning: docs/flags.md.",
    )
    add_groups(serve, serve_flags.SERVE)
    validate = sub.add_parser("validate", help="check a pool file and/or a scheduler config")
    add_arguments(validate, serve_flags.VALIDATE)
    sub.add_parser("sim", help="run simulated vLLM servers (see `epp sim --help`)", add_help=False)
    sub.add_parser("bench", help="measure routing quality (see `epp bench --help`)", add_help=False)
    sub.add_parser(
        "envoy-config",
        help="render an Envoy config (see `epp envoy-config --help`)",
        add_help=False,
    )
    return parser


async def _serve(settings: Settings) -> None:
    from endpoint_picker.app import (  # grpc: keep --help fast
        App,
        freeze_startup_heap,
        return_large_blocks_to_os,
    )

    return_large_blocks_to_os()
    if settings.server.supervised:
        from endpoint_picker.workers import build_parent

        app = build_parent(settings)
    else:
        app = App(settings, before_listen=freeze_startup_heap)
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            app.request_stop()  # drain
        else:  # a second Ctrl-C / SIGTERM: the operator wants out now
            print("epp: second signal, exiting without draining", file=sys.stderr)
            app.kill_workers()  # or they would drain on their own, holding the port
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await app.start()
        if settings.server.supervised:  # the parent routes nothing: no request to hold
            freeze_startup_heap()
        await app.wait_stopped()
    finally:
        await app.stop()


def _validate(args: argparse.Namespace) -> int:
    from endpoint_picker.datastore.pool import pool_pods, resolve_pool
    from endpoint_picker.datastore.sources.file import load_pool_file
    from endpoint_picker.director import criticality_of_priority
    from endpoint_picker.scheduling import describe, load_config

    if args.pool_file is None and args.config_file is None:
        raise ConfigError("give --pool-file and/or --config-file")
    if args.pool_file is not None:
        state = load_pool_file(args.pool_file)
        resolved = resolve_pool(state, args.pool_name)
        pool = resolved.pool
        print(
            f"{args.pool_file}: InferencePool {pool.namespace}/{pool.name} ({pool.api_version}), "
            f"ports {', '.join(map(str, pool.target_ports))}"
        )
        for model in resolved.models.values():
            split = ", ".join(f"{t.name}={t.weight}" for t in model.target_models) or "no split"
            print(f"  model {model.model_name}: {model.criticality.value}, {split}")
        for objective in resolved.objectives.values():
            crit = criticality_of_priority(objective.priority).value
            print(f"  objective {objective.name}: priority {objective.priority} ({crit})")
        for endpoint in resolved.endpoints:
            print(f"  endpoint {endpoint.hostport} (pod {endpoint.pod_name})")
        unready = sum(1 for p in pool_pods(pool, state.pods) if not (p.ready and p.pod_ip))
        print(
            f"  {len(resolved.endpoints)} endpoints; {len(state.pods) - resolved.pod_count} pods "
            f"not in the pool, {unready} of the pool not Ready or without an IP"
        )
        # A warning, not an error: serving takes the file and routes to each address once,
        # so validate exits 0 (as for NotReady pods) and says it where a CI log shows it.
        for duplicate in resolved.duplicates:
            print(f"epp: warning: duplicate pod address: {duplicate.describe()}", file=sys.stderr)
    if args.config_file is not None:
        try:
            text = args.config_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", str(args.config_file)) from exc
        # load_config builds every plugin once, so it catches what serving would
        print(describe(load_config(text, str(args.config_file))))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from endpoint_picker_sim.cli import main as sim_main

        return int(sim_main(argv[1:]))
    if argv[:1] == ["bench"]:
        from endpoint_picker.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["envoy-config"]:
        from endpoint_picker.envoy_config import main as envoy_config_main

        return envoy_config_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            settings = settings_from_args(args)
            configure_logging(settings.logging.format, settings.logging.level)
            asyncio.run(_serve(settings))
            return 0
        if args.command == "validate":
            return _validate(args)
    except ConfigError as exc:
        print(f"epp: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.print_help()
    return EXIT_USAGE
