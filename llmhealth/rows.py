"""A document's long list or table whose rows are made as it is written, not before.

The state document of 3,000 backends held every ledger entry (a dict of 23 fields) and
every sighting as dicts at once before a byte was written: about 1.5 KB per backend of
the settle's peak memory, for a text written 64 rows at a time. ``Rows`` and ``Table``
hold the entries and the rule that makes each row; the writer asks for the rows a piece
at a time, and ``plain`` gives the whole to a writer that takes it whole (json's
``default``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Rows(Generic[T]):
    """``[row(item) for item in items]``, made a slice at a time."""

    __slots__ = ("_items", "_row")

    def __init__(self, items: Sequence[T], row: Callable[[T], object]) -> None:
        self._items = items
        self._row = row

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[object]:
        return map(self._row, self._items)

    def __getitem__(self, run: slice) -> list[object]:
        """The rows of one run of items, made now (``encode_pieces`` asks for runs)."""
        return [self._row(item) for item in self._items[run]]


class Table(Mapping[str, object], Generic[T]):
    """``{key: row(item) for key, item in items.items()}``, each row made when asked."""

    __slots__ = ("_items", "_row")

    def __init__(self, items: Mapping[str, T], row: Callable[[T], object]) -> None:
        self._items = items
        self._row = row

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __getitem__(self, key: str) -> object:
        return self._row(self._items[key])


def plain(value: object) -> object:
    """json's ``default`` for a document that may hold Rows or a Table: the whole."""
    if isinstance(value, Rows):
        return list(value)
    if isinstance(value, Table):
        return dict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
