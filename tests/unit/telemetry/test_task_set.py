"""TaskSet: the named, guarded background tasks an app owns."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from endpoint_picker.telemetry.tasks import TaskSet


async def test_a_failing_task_is_logged_by_name_and_the_others_keep_running() -> None:
    """An error in one loop is logged with its name; it neither raises nor stops the rest."""
    tasks = TaskSet()

    async def fail() -> None:
        raise RuntimeError("boom")

    async def forever() -> None:
        await asyncio.Event().wait()

    with capture_logs() as logs:
        tasks.spawn([("boom", fail()), ("loop", forever())])
        assert tasks.names == ["boom", "loop"]
        await asyncio.sleep(0.01)
    assert [(e["event"], e["task"]) for e in logs] == [("background task failed", "boom")]
    assert {t.get_name() for t in asyncio.all_tasks()} >= {"loop"}
    await tasks.cancel()
    assert tasks.names == []


async def test_cancel_waits_until_every_task_has_ended() -> None:
    """``cancel`` returns only after each task ran its cleanup; none is left behind."""
    tasks = TaskSet()
    cleaned: list[str] = []

    async def loop(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits
            cleaned.append(name)

    tasks.spawn([("a", loop("a")), ("b", loop("b"))])
    await asyncio.sleep(0)
    await tasks.cancel()
    assert sorted(cleaned) == ["a", "b"]
    assert not {t.get_name() for t in asyncio.all_tasks()} & {"a", "b"}
