"""How the values a read worker sends the daemon are pickled: as a call of their class.

Pure. A frozen slots dataclass pickles through the state functions ``dataclasses`` gives
it, which look the class's fields up again for every object and set each one through
``object.__setattr__``. An examination crosses a read worker's pipe as a few such objects
(the read, its signals, each engine's signals, the verdict), 10,000 of them a wait at
10,000 backends, and the daemon unpickles them on the loop that takes in every frame.
Pickled as the class and its fields' values, in order, an object is rebuilt by calling
the class, as the code that made it did: bench/README.md ("The pipe's pickles") has the
figures. A field the class does not take (``init=False``) is left to ``__post_init__``,
which rebuilds it.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import Any, TypeVar

_Class = TypeVar("_Class", bound=type)


def pickled_as_a_call(cls: _Class) -> _Class:
    """``cls`` (a dataclass of at least two fields it takes) pickled as ``cls(*values)``."""
    names = [field.name for field in fields(cls) if field.init]
    if len(names) < 2:  # attrgetter of one name gives the value, not a tuple of values
        raise TypeError(f"{cls.__name__}: needs two or more fields to pickle as a call")
    values = attrgetter(*names)

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:  # noqa: N807 - pickle's hook
        return cls, values(self)

    setattr(cls, "__reduce__", __reduce__)  # noqa: B010 - mypy rejects assigning a method
    return cls
