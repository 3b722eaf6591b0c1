"""What both servers share: stream slots, the refusals' JSON 429s, the flow-control wait."""

from __future__ import annotations

import asyncio

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from tests.support.extproc import error_of, headers

from endpoint_picker.extproc.limits import StreamSlots
from endpoint_picker.extproc.session import ExternalProcessor
from endpoint_picker.telemetry.metrics import EppMetrics


class Waits:
    """A session whose first message waits in flow control until ``resume``."""

    def __init__(self) -> None:
        self.queued = False
        self.finished = False
        self.request_id = ""
        self.closed = 0

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.queued = True
        return []

    async def resume(self) -> list[pb.ProcessingResponse]:
        self.queued = False
        await asyncio.sleep(0)
        return [pb.ProcessingResponse()]

    def close(self) -> None:
        self.closed += 1


def test_a_stream_past_the_slots_is_refused_closed_and_counted() -> None:
    """Past --max-concurrent-streams open_stream returns None (the session it built closed,
    the refusal counted); closing a stream frees its slot; the refusal is a JSON 429."""
    sessions: list[Waits] = []

    def new() -> Waits:
        sessions.append(Waits())
        return sessions[-1]

    metrics = EppMetrics()
    processor = ExternalProcessor(new, StreamSlots(1), metrics)
    first = processor.open_stream()
    assert first is not None
    assert processor.open_stream() is None
    assert sessions[1].closed == 1
    assert metrics.stream_limit_rejections._value.get() == 1
    processor.close_stream(first)
    assert processor.open_stream() is not None
    assert error_of(processor.refusal())[0] == 429
    assert error_of(processor.budget_refusal())[0] == 429
    assert metrics.buffer_budget_rejections._value.get() == 1


async def test_answer_awaits_the_flow_control_wait() -> None:
    """answer() returns what resume() gives when handle() leaves the request queued."""
    session = Waits()
    out = await ExternalProcessor(lambda: session).answer(session, headers())
    assert out == [pb.ProcessingResponse()]
    assert not session.queued
