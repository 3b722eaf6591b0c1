"""Tiny builders for simulator tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from endpoint_picker_sim.clock import ManualClock
from endpoint_picker_sim.config import EngineConfig, LoraModule, ServerConfig
from endpoint_picker_sim.engine import Engine
from endpoint_picker_sim.request import SimRequest
from endpoint_picker_sim.tokenizer import tokenize_text


def engine(**overrides: Any) -> tuple[Engine, ManualClock]:
    """An engine on a manual clock; overrides go to ``EngineConfig``."""
    clock = ManualClock()
    return Engine(replace(EngineConfig(), **overrides), clock), clock


def request(text: str, max_tokens: int = 4, lora: str | None = None) -> SimRequest:
    """A request for ``text`` (16-token blocks)."""
    tok = tokenize_text(text, 16, lora)
    return SimRequest(tok.num_tokens, tok.block_hashes, max_tokens, lora)


def prompt(tokens: int, seed: str = "p") -> str:
    """A prompt of exactly ``tokens`` tokens whose content depends on ``seed``."""
    unit = (seed * 4)[:4]
    return unit * tokens


def run(
    eng: Engine,
    clock: ManualClock,
    steps: int = 10_000,
    until: Callable[[], bool] | None = None,
) -> int:
    """Step the engine by hand (no sleeping) until idle, ``until()`` or ``steps``; return steps."""
    done = 0
    while done < steps and not eng.idle and not (until and until()):
        batch, duration = eng.step()
        clock.t += duration
        eng.commit(batch, clock.t)
        done += 1
    return done


def server_config(**engine_overrides: Any) -> ServerConfig:
    """A fast server: 50x real time, two adapters, small KV unless overridden."""
    engine_overrides.setdefault("time_scale", 50.0)
    return ServerConfig(
        model="meta-llama/Llama-3.1-8B-Instruct",
        lora_modules=(LoraModule("sql-lora", "/adapters/sql"), LoraModule("tweet", "/a/t")),
        engine=replace(EngineConfig(), **engine_overrides),
        seed=7,
    )
