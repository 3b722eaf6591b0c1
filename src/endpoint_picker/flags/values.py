"""What a flag's text may be: the readers argparse calls (its ``type=``), one per kind of value.

Each raises ``ConfigError`` (or ``ValueError``, which argparse words as "invalid <name> value")
and is wrapped by ``typed`` so that argparse prints the error as one usage line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from endpoint_picker.errors import ConfigError
from endpoint_picker.settings import parse_bool, parse_duration
from endpoint_picker.types import MAX_PORT, ascii_int


def typed(convert: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """Turn a ``ConfigError`` from a converter into argparse's own error."""

    def wrapper(text: str) -> Any:
        try:
            return convert(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    wrapper.__name__ = name  # argparse says "invalid <name> value"
    return wrapper


def port(text: str) -> int:
    value = ascii_int(text.strip(), MAX_PORT)
    if value is None:
        raise ConfigError(f"invalid port value: {text!r} (a number in 0..{MAX_PORT})")
    return value


def non_negative(text: str) -> int:
    value = ascii_int(text.strip(), 2**63 - 1)
    if value is None:
        raise ConfigError(f"invalid count value: {text!r} (a whole number >= 0)")
    return value


def cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs the cgroup v2 quota allows, rounded up (a large number when unlimited or unknown)."""
    try:
        quota, _, period = Path(path).read_text(encoding="ascii").partition(" ")
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):  # "max", no cgroup v2, or unreadable
        return 1 << 16


def workers(text: str) -> int:
    """``N`` >= 1, or ``auto``: the cores this process may run on, capped by the cgroup's CPU
    quota (a pod limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    if text.strip() == "auto":
        return max(1, min(len(os.sched_getaffinity(0)), cgroup_cpus()))
    value = ascii_int(text.strip(), 1 << 16)
    if not value:
        raise ConfigError(f"{text!r} is not a number >= 1 or auto")
    return value


def percent(text: str) -> int:
    value = int(text)  # ValueError: argparse's "invalid percentage value"
    if not 0 <= value <= 100:
        raise ConfigError(f"{value} is not a percentage 0..100")
    return value


def inference_path(text: str) -> str:
    """An absolute path without query, e.g. ``/v1/rerank``."""
    path = text.strip()
    if not path.startswith("/") or "?" in path or any(c.isspace() for c in path):
        raise ConfigError(f"invalid path {text!r} (use an absolute path such as /v1/rerank)")
    return path


def engine_metric(text: str) -> tuple[str, str, str]:
    """``ENGINE.FIELD=SPEC`` (e.g. ``sglang.queue=sglang:num_queue_reqs``)."""
    key, sep, spec = text.partition("=")
    engine, dot, field = key.partition(".")
    if not sep or not dot or not engine or not field:
        raise ConfigError(f"invalid --engine-metric {text!r} (use ENGINE.FIELD=METRIC)")
    return engine.strip(), field.strip(), spec.strip()


def tokenizer(text: str) -> tuple[str, Path]:
    """``MODEL=PATH`` (that model's tokenizer) or ``PATH`` (every model's): a tokenizer.json
    or a directory holding one."""
    model, sep, path = text.rpartition("=") if "=" in text else ("", "", text)
    if sep and not model.strip():
        raise ConfigError(f"invalid --tokenizer {text!r} (use MODEL=PATH or PATH)")
    file = Path(path.strip())
    if not (file.is_file() or (file / "tokenizer.json").is_file()):
        raise ConfigError(f"--tokenizer {text!r}: no tokenizer.json at {str(file)!r}")
    return model.strip(), file


DURATION = typed(parse_duration, "duration")
BOOL = typed(parse_bool, "boolean")
PORT = typed(port, "port")
COUNT = typed(non_negative, "count")
WORKERS = typed(workers, "workers")
PERCENT = typed(percent, "percentage")
INFERENCE_PATH = typed(inference_path, "path")
ENGINE_METRIC = typed(engine_metric, "engine metric")
TOKENIZER = typed(tokenizer, "tokenizer")
