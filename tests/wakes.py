"""A loop's wake-ups, counted: what a library call leaves running in its caller's loop."""

from __future__ import annotations

import selectors
from typing import Any


class CountedSelector(selectors.DefaultSelector):
    """The loop's own selector, counting the times the loop woke from it."""

    wakes = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        self.wakes += 1
        return list(super().select(timeout))
