"""The last routing decisions and refusals, for the status page: small, bounded, prompt-free.

Two writers, both on the request path, both cheap:

- ``record``, the scheduler's sink: each routed cycle arrives as a ``CycleRecord`` tuple of
  references the cycle built anyway (the request id, model names, the primary profile, the
  endpoints it chose and, for one cycle every 20 ms, its running score sums: see
  ``scheduling.scheduler``), kept as it is unless a client string in it is long;
- ``rejected`` is called by the ext_proc stream when it answers an error (status, the
  message the client got, the model when it was known).

The request object itself is never kept (its body is the prompt): only its id and model names,
each cut by ``errors.kept`` (a client chooses them: 50 decisions holding 8 MB model names held
400 MB and made one ``/api/status`` answer 800 MB). ``recent()`` turns the ring into
JSON-ready dicts when someone asks, newest first, with the client's strings ``errors.shown``:
control and bidi characters escaped, so a right-to-left override cannot reorder the page.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from endpoint_picker.errors import CLIP_CHARS, ErrorCode, kept, shown
from endpoint_picker.scheduling.scheduler import CycleRecord
from endpoint_picker.types import EndpointState

DEFAULT_SIZE = 50
MESSAGE_CHARS = 1000  # an error message as kept (the stream sends at most this much)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request answered with an error by the EPP itself."""

    time: float  # wall clock, seconds
    request_id: str
    model: str
    target_model: str
    code: ErrorCode
    message: str  # as sent to the client: clipped, client values in it cut to 200 characters


class DecisionLog:
    """A ring of the last ``size`` decisions; ``record`` is the scheduler's sink."""

    __slots__ = ("_append", "_clock", "_ring")

    def __init__(self, size: int = DEFAULT_SIZE, *, clock: Callable[[], float] = time.time):
        self._ring: deque[CycleRecord | Refusal] = deque(maxlen=size)
        self._append = self._ring.append
        self._clock = clock

    def record(self, cycle: CycleRecord) -> None:
        """The scheduler's sink: keep ``cycle``, its client strings cut (``errors.kept``)."""
        # three length checks in the common case: no copy, no call
        if len(cycle[1]) > CLIP_CHARS or len(cycle[2]) > CLIP_CHARS or len(cycle[3]) > CLIP_CHARS:
            when, request_id, model, target, candidates, profile, picked, scores = cycle
            cycle = (when, kept(request_id), kept(model), kept(target), candidates, profile,
                     picked, scores)  # fmt: skip
        self._append(cycle)

    def rejected(
        self, request_id: str, model: str, target_model: str, code: ErrorCode, message: str
    ) -> None:
        """The stream answered ``code`` with ``message`` (the client's own error body)."""
        model = kept(model)
        self._ring.append(
            Refusal(
                self._clock(),
                kept(request_id),
                model,
                kept(target_model) if target_model else model,
                code,
                kept(message, MESSAGE_CHARS),
            )
        )

    def __len__(self) -> int:
        return len(self._ring)

    def recent(self) -> list[dict[str, Any]]:
        """The ring as JSON-ready dicts, newest first (the schema is in docs/status-page.md)."""
        return [_describe(item) for item in reversed(list(self._ring))]


def _describe(item: CycleRecord | Refusal) -> dict[str, Any]:
    if isinstance(item, Refusal):
        return {
            "time": item.time,
            "requestId": shown(item.request_id),
            "model": shown(item.model),
            "targetModel": shown(item.target_model),
            "endpoints": [],
            "profile": None,
            "candidates": None,
            "passedFilters": None,
            "chosen": None,
            "runnerUp": None,
            "error": {
                "status": item.code.http_status,
                "code": item.code.type_name,
                "message": shown(item.message),
            },
        }
    when, request_id, model, target_model, candidates, profile, picked, cycle = item
    described: dict[str, Any] = {
        "time": when,
        "requestId": shown(request_id),
        "model": shown(model),
        "targetModel": shown(target_model),
        "endpoints": [e.hostport for e in picked],
        "profile": profile.name,
        "candidates": candidates,
        "passedFilters": None,
        "chosen": None,
        "runnerUp": None,
        "error": None,
    }
    if cycle is None:  # not sampled (see scheduling.scheduler.SCORES_INTERVAL)
        return described
    endpoints, sums = cycle
    described["passedFilters"] = len(endpoints)
    names = [name for name, _ in profile.scorer_weights]
    chosen = _index_of(endpoints, picked[0])
    if chosen is not None:
        described["chosen"] = _scores(endpoints, sums, names, chosen)
        totals = sums[-1]
        others = [i for i in range(len(endpoints)) if i != chosen]
        if others:
            runner_up = max(others, key=totals.__getitem__)
            described["runnerUp"] = _scores(endpoints, sums, names, runner_up)
    return described


def _index_of(endpoints: Sequence[EndpointState], state: EndpointState) -> int | None:
    for i, candidate in enumerate(endpoints):
        if candidate is state or candidate.hostport == state.hostport:
            return i
    return None


def _scores(
    endpoints: Sequence[EndpointState], sums: list[list[float]], names: list[str], i: int
) -> dict[str, Any]:
    """One endpoint's total and each scorer's weighted share (differences of running sums)."""
    return {
        "endpoint": endpoints[i].hostport,
        "total": round(sums[-1][i], 4),
        "byScorer": {
            name: round(sums[k + 1][i] - sums[k][i], 4)
            for k, name in enumerate(names)
            if k + 1 < len(sums)
        },
    }
