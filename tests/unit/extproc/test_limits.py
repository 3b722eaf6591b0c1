"""The process-wide limits as plain counters."""

from __future__ import annotations

import pytest

from endpoint_picker.extproc.limits import BodyBudget, StreamSlots


@pytest.mark.parametrize("limit", [0, 3])
def test_body_budget_reserves_up_to_its_limit_and_zero_means_none(limit: int) -> None:
    """try_reserve takes bytes only while they fit (limit 0: always); release gives them back."""
    budget = BodyBudget(limit)
    assert budget.try_reserve(2)
    assert budget.try_reserve(2) is (limit == 0)
    budget.release(budget.reserved)
    assert budget.reserved == 0
    slots = StreamSlots(1 if limit else 0)
    assert slots.try_acquire()
    assert slots.try_acquire() is (limit == 0)
