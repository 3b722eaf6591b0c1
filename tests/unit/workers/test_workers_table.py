"""The shared in-flight table: each worker's own row, the others' summed, slots reused late."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from endpoint_picker.requests import Api, LLMRequest
from endpoint_picker.scheduling.lifecycle import Finished, Routed, SharedInFlight
from endpoint_picker.scheduling.plugins.affinity import InFlightLoadScorer
from endpoint_picker.types import Endpoint, EndpointState, MetricsSnapshot
from endpoint_picker.workers.table import InFlightTable, SlotMap, TableCounts, TableRow

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def routed(request_id: str, endpoint: str) -> Routed:
    request = LLMRequest(
        request_id=request_id, api=Api.COMPLETIONS, model="m", raw_body=b"{}", body={}
    )
    return Routed(request, endpoint)


@pytest.fixture
def table() -> Iterator[InFlightTable]:
    table = InFlightTable.create(rows=3, capacity=8)
    yield table
    table.close()


def workers(table: InFlightTable, slots: dict[str, int]) -> list[SharedInFlight]:
    rows = [TableRow(table, index) for index in range(table.rows)]
    for row in rows:
        row.remap(slots, {})
    return [SharedInFlight(row) for row in rows]


def test_a_worker_sees_its_own_count_plus_the_other_rows(table: InFlightTable) -> None:
    """Counts routed by two workers add up in every worker's view; own counts stay exact."""
    first, second, third = workers(table, {A: 0, B: 1})
    first.on_routed(routed("r1", A))
    first.on_routed(routed("r2", A))
    second.on_routed(routed("r3", A))
    second.on_routed(routed("r4", B))
    assert [w.count(A) for w in (first, second, third)] == [3, 3, 3]
    assert third.count(B) == 1
    assert first.own_counts == {A: 2}
    assert first.total == 2  # its own requests only
    first.on_finished(Finished("r1", ok=True))
    first.on_finished(Finished("r1", ok=True))  # a second finish changes nothing
    assert third.count(A) == 2
    assert table.cell(0, 0) == 1


def test_a_moved_request_id_moves_its_published_count(table: InFlightTable) -> None:
    """A request id reused while in flight moves from one endpoint to the other in the table."""
    first, second, _ = workers(table, {A: 0, B: 1})
    first.on_routed(routed("r1", A))
    first.on_routed(routed("r1", B))
    assert (second.count(A), second.count(B)) == (0, 1)


def test_a_dead_workers_row_is_cleared(table: InFlightTable) -> None:
    """The parent zeroes a dead worker's row: its requests leave every other worker's view."""
    first, second, _ = workers(table, {A: 0})
    first.on_routed(routed("r1", A))
    assert second.count(A) == 1
    slots = SlotMap()
    slots.update([A])  # the first fresh slot: 0, as the workers were mapped
    assert TableCounts(table, slots).total == 1
    table.clear_row(0)
    assert second.count(A) == 0
    assert TableCounts(table, slots).total == 0


def test_slots_are_stable_and_freed_slots_are_reused_last() -> None:
    """An endpoint keeps its slot; fresh slots go first; a freed slot is reused only after."""
    slots = SlotMap(capacity=3)
    assert slots.update([A, B]) == {A: 0, B: 1}
    assert slots.update([B, C]) == {B: 1, C: 2}  # A's slot 0 freed, C gets a fresh one
    assert slots.update([B, C, A]) == {B: 1, C: 2, A: 0}  # no fresh slot left: reuse 0
    assert slots.update([B, C, A, "x:1"]) == {B: 1, C: 2, A: 0}  # past capacity: no slot


def test_a_remap_rewrites_the_row_for_the_new_slots(table: InFlightTable) -> None:
    """New slots rewrite the whole row: a reused slot no longer carries a departed endpoint."""
    rows = [TableRow(table, 0), TableRow(table, 1)]
    rows[1].remap({A: 0}, {})
    mine = SharedInFlight(rows[0])
    rows[0].remap({A: 0}, {})
    mine.on_routed(routed("r1", A))
    assert rows[1].others(A) == 1
    rows[0].remap({B: 0}, mine.own_counts)  # A left, B took its slot
    rows[1].remap({B: 0}, {})
    assert rows[1].others(B) == 0
    assert mine.count(A) == 1  # its own request on A still finishes through its stream


def test_in_flight_requests_of_one_worker_move_another_workers_scores(
    table: InFlightTable,
) -> None:
    """The inflight-load scorer of one worker prefers the endpoint the other worker left idle."""
    first, second, _ = workers(table, {A: 0, B: 1})
    endpoints = [
        EndpointState(Endpoint(f"p{i}", "ns", f"10.0.0.{i}", 8000), MetricsSnapshot())
        for i in (1, 2)
    ]
    scorer = InFlightLoadScorer(second)
    request = routed("x", A).request
    assert scorer.score(request, endpoints) == [1.0, 1.0]
    first.on_routed(routed("r1", A))
    assert scorer.score(request, endpoints) == [0.0, 1.0]
