"""Process-wide memory settings, asked for by a process's entry point (``epp serve``, a worker),
never by ``App`` itself: tests run many apps in one process."""

from __future__ import annotations

import ctypes
import gc
import platform


def freeze_startup_heap() -> None:
    """Take what start-up built out of the garbage collector's full passes.

    A process that serves keeps nearly everything it imported and built before its first
    request (modules, protobuf descriptors, the pool, the placement ring): a few hundred
    thousand objects that every gen-2 collection walks again, 40-100 ms a time during which no
    pick is answered. Frozen (``gc.freeze``), they are skipped; what is built later is
    collected as usual. Process-wide, so the process's entry point asks for it (``epp serve``
    and a worker, once the pool is in and before ext_proc listens, so that the collection it
    starts with holds no request; a workers' parent, which routes nothing, once started), never
    ``App`` itself (tests run many apps in one process).
    """
    gc.collect()
    gc.freeze()


# glibc's M_MMAP_THRESHOLD (malloc.h): blocks at least this large get their own mapping.
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 128 * 1024


def return_large_blocks_to_os() -> bool:
    """Give request bodies' memory back to the OS when they are freed; True where it applies.

    glibc serves a block of 128 KiB or more from its own mapping, returned on ``free``, but
    raises that threshold to the largest such block freed so far: after the first 1 MB body,
    bodies come from the heap, which keeps what they leave (300 queued 1 MB requests that
    expired left 1.1 GiB of RSS with nothing referencing them). Setting the threshold fixes it
    where it is. Process-wide, so only entry points call it (``epp serve``, a worker), at start.
    """
    if platform.libc_ver()[0] != "glibc":
        return False  # musl and others already unmap large blocks on free
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))
