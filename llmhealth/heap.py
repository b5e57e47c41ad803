"""Handing the C heap's free pages back to the kernel, once per cycle of `watch`.

A `watch` reads every backend's 53 KB `/metrics` body each wait: C heap blocks under
glibc's default mmap threshold, freed moments later, between blocks that live on, and
the likeliest source of the free pages (which blocks left them was not traced). glibc
returns only the free space at the top of its heap on its own, so the freed pages in
between stayed resident: over 30 cycles at
3,000 backends, alternated, the daemon levelled off at 135-136 MiB, and at 127-131 MiB
when it handed them back after each settle; with two read workers 205 against 199-200
MiB in all (bench/README.md, "A long `watch`"); CPU per cycle the same. Nothing else
changes: no allocator setting, no allocation moved; the pages are given back, and
faulted in again when the heap needs them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, from the symbols this process already has loaded; None
    with another C library (musl, macOS), where there is nothing to call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def give_back_free_pages() -> bool:
    """Return the C heap's free pages to the kernel; whether any were returned."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1
