"""The serving process's start-up heap is frozen out of full garbage collections."""

from __future__ import annotations

import gc

from endpoint_picker.app import freeze_startup_heap


class Node:
    """A tracked object in a reference cycle, as start-up builds many."""

    def __init__(self) -> None:
        self.me = self


def test_what_exists_at_start_is_frozen_and_what_comes_later_is_collected() -> None:
    gc.unfreeze()
    built_at_start = Node()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        # frozen: no generation holds it, so no collection walks it again
        assert not any(obj is built_at_start for obj in gc.get_objects())
        built_later = Node()
        assert any(obj is built_later for obj in gc.get_objects())
    finally:
        gc.unfreeze()
