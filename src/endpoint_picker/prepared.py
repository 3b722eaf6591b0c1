"""A request whose scheduling waits for work off the event loop (tokenizing a long prompt).

The director asks the scheduler's ``Preparer`` plugins before scheduling; when one hands back
blocking work, the request comes back to the stream as a ``QueuedRoute`` (as one waiting in flow
control does): the work runs on the loop's default executor, its result is kept on the loop,
then the request is admitted or scheduled as it would have been, and the route's future
resolves with the decision (or the error). A client that leaves cancels the future, which
cancels the wait (the thread's work still ends, and its result is kept for the next request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from endpoint_picker.exchange import QueuedRoute, RoutingDecision
from endpoint_picker.requests import LLMRequest
from endpoint_picker.scheduling import OffLoopWork

_running: set[asyncio.Task[None]] = set()  # kept from the garbage collector until they end


def after_work(
    request: LLMRequest,
    work: Sequence[OffLoopWork],
    then: Callable[[], RoutingDecision | QueuedRoute],
) -> QueuedRoute:
    """Run ``work`` on threads, then ``then`` on the loop. Each item's callback runs on the
    loop once its thread is done, even when the client left meanwhile (a plugin counts its
    pending work by them); an item must not raise."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[RoutingDecision] = loop.create_future()

    async def run() -> None:
        try:
            threads = [loop.run_in_executor(None, item) for item in work]
            try:
                finishes = await asyncio.shield(asyncio.gather(*threads))
            except asyncio.CancelledError:
                for thread in threads:
                    thread.add_done_callback(_finish_later)
                raise
            for finish in finishes:
                finish()
            outcome = then()
            decision = outcome if isinstance(outcome, RoutingDecision) else await outcome.future
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RequestError above all: the stream answers it
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(decision)

    task = loop.create_task(run(), name="prepare-request")
    _running.add(task)
    task.add_done_callback(_running.discard)
    future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
    return QueuedRoute(request, future)


def _finish_later(thread: asyncio.Future[Callable[[], None]]) -> None:
    if not thread.cancelled() and thread.exception() is None:
        thread.result()()


def run_inline(work: Sequence[OffLoopWork]) -> None:
    """Where no stream waits (``Director.route``): do the work here and now."""
    for item in work:
        item()()
