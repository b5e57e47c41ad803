"""Giving the C heap's free pages back: what `watch` does after each settle (heap.py).

On this process's own heap, laid out as a wait of `/metrics` bodies leaves it: blocks
under glibc's mmap threshold freed between blocks that live on. Their pages stay
resident until handed back, and leave when they are.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from llmhealth.heap import give_back_free_pages

BODY = 64 * 1024  # about a /metrics body: a C heap block, under the mmap threshold
BODIES = 1024  # 64 MiB of them
PIN = 1024  # a block that lives on between two bodies: more than pymalloc takes


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_pages_that_freed_bodies_left_resident_are_given_back() -> None:
    give_back_free_pages()  # start from a heap with nothing to give back
    bodies: list[bytes] = []
    pins: list[bytes] = []
    for index in range(BODIES):
        bodies.append(bytes([index % 251]) * BODY)  # written through: resident
        pins.append(bytes([index % 251]) * PIN)
    held = resident_mib()
    bodies.clear()
    freed = resident_mib()
    # Freed between the pins, the bodies' pages stay: glibc trims only the heap's top.
    assert held - freed < 16, (held, freed)
    assert give_back_free_pages()
    given_back = resident_mib()
    assert freed - given_back > 32, (held, freed, given_back)
    assert len(pins) == BODIES  # the pins lived throughout
