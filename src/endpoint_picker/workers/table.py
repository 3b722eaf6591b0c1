"""In-flight counts per endpoint, shared by every worker process on the machine.

A table of int64 counters in shared memory: one row per worker, one column (a *slot*) per
endpoint. Each worker writes only its own row, so no lock is needed: a row's cell is one aligned
8-byte store, and a reader summing the other rows sees every cell either before or after a
write. The parent assigns slots (``SlotMap``) and sends them with every endpoint set; it zeroes a
dead worker's row before it starts the replacement.

The memory is a ``memfd`` (anonymous, freed when the last process closes it) handed to the
workers by file-descriptor inheritance, rather than ``multiprocessing.shared_memory``: on
Python 3.11 every process that attaches a named segment registers it with a resource tracker
(its own helper process) that unlinks it when that process exits, so one dying worker would
tear the table away from the others (fixed only by 3.13's ``track=False``).
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Iterable, Mapping

CELL = 8  # bytes: one int64
DEFAULT_CAPACITY = 4096  # slots; endpoints past it are counted by their own worker only


class InFlightTable:
    """``rows`` x ``capacity`` int64 cells in a memfd; ``fd`` is inherited by the workers."""

    __slots__ = ("_map", "capacity", "cells", "fd", "rows")

    def __init__(self, fd: int, rows: int, capacity: int) -> None:
        self.fd = fd
        self.rows = rows
        self.capacity = capacity
        self._map = mmap.mmap(fd, rows * capacity * CELL)
        self.cells = memoryview(self._map).cast("q")  # row-major: row * capacity + slot

    @classmethod
    def create(cls, rows: int, capacity: int = DEFAULT_CAPACITY) -> InFlightTable:
        """A zeroed table (the parent); its fd goes to the workers through ``pass_fds``."""
        fd = os.memfd_create("epp-inflight")  # close-on-exec: only the workers get it
        os.ftruncate(fd, rows * capacity * CELL)
        return cls(fd, rows, capacity)

    def cell(self, row: int, slot: int) -> int:
        return int(self.cells[row * self.capacity + slot])

    def set(self, row: int, slot: int, value: int) -> None:
        self.cells[row * self.capacity + slot] = value

    def column(self, slot: int, skip: int = -1) -> int:
        """The sum of ``slot`` over every row but ``skip``."""
        cells, capacity = self.cells, self.capacity
        return sum(cells[row * capacity + slot] for row in range(self.rows) if row != skip)

    def clear_row(self, row: int) -> None:
        start = row * self.capacity * CELL
        self._map[start : start + self.capacity * CELL] = bytes(self.capacity * CELL)

    def close(self) -> None:
        self.cells.release()
        self._map.close()
        os.close(self.fd)


class TableRow:
    """One worker's view: writes its own row, reads the others' (``scheduling.PeerCounts``)."""

    __slots__ = ("_others", "_row", "_slots", "_table")

    def __init__(self, table: InFlightTable, row: int) -> None:
        self._table = table
        self._row = row
        self._slots: Mapping[str, int] = {}
        # Where the other rows start: a pick reads one cell per other worker and candidate
        # (two endpoint-load passes over 64-plus candidates), so no generator per read.
        self._others = tuple(r * table.capacity for r in range(table.rows) if r != row)

    def others(self, hostport: str) -> int:
        slot = self._slots.get(hostport)
        if slot is None:
            return 0
        cells = self._table.cells
        total = 0
        for start in self._others:
            total += cells[start + slot]
        return total

    def publish(self, hostport: str, count: int) -> None:
        slot = self._slots.get(hostport)
        if slot is not None:
            self._table.set(self._row, slot, count)

    def remap(self, slots: Mapping[str, int], own: Mapping[str, int]) -> None:
        """New slots from the parent: rewrite the whole row from this worker's own counts."""
        self._table.clear_row(self._row)
        self._slots = dict(slots)
        for hostport, slot in self._slots.items():
            count = own.get(hostport, 0)
            if count:
                self._table.set(self._row, slot, count)


class SlotMap:
    """The parent's slot assignment: stable while an endpoint stays, reused last when freed.

    A freed slot goes to the back of a queue and fresh slots are handed out first, so a slot
    is reused as late as possible: a worker still holding counts under an endpoint that left
    rewrites its row when the new map reaches it, and the gap makes that window rarely matter.
    """

    __slots__ = ("_capacity", "_free", "_next", "slots")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._next = 0
        self._free: deque[int] = deque()
        self.slots: dict[str, int] = {}

    def update(self, hostports: Iterable[str]) -> dict[str, int]:
        """Assign slots to ``hostports`` (the live endpoints); returns a copy of the map."""
        live = list(dict.fromkeys(hostports))
        wanted = set(live)
        for gone in [h for h in self.slots if h not in wanted]:
            self._free.append(self.slots.pop(gone))
        for hostport in live:
            if hostport in self.slots:
                continue
            if self._next < self._capacity:
                self.slots[hostport] = self._next
                self._next += 1
            elif self._free:
                self.slots[hostport] = self._free.popleft()
            # else: past capacity, only its own worker counts it
        return dict(self.slots)


class TableCounts:
    """Every worker's in-flight counts summed (the parent's status page)."""

    __slots__ = ("_map", "_table")

    def __init__(self, table: InFlightTable, slot_map: SlotMap) -> None:
        self._table = table
        self._map = slot_map

    def count(self, hostport: str) -> int:
        slot = self._map.slots.get(hostport)
        return 0 if slot is None else self._table.column(slot)

    @property
    def total(self) -> int:
        return sum(self._table.column(slot) for slot in self._map.slots.values())
