"""``BoundedMemo``: values computed once per key in this process, the oldest dropped past a bound, safe to share
between threads (the app prices and reads tokenizers on its handlers' threads and its background planner's).

A leaf module: it imports nothing of the project.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


class BoundedMemo:
    """``get(key, make)``: ``make()`` once per ``key`` while it stays among the last ``keep`` keys made."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._values: dict[Hashable, object] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value made for ``key``, made now if it is not kept (a key that cannot be hashed, e.g. a tuple
        holding lists: made every time, never kept). Two threads asking for a new key at once may both make it."""
        try:
            found = self._values.get(key)
        except TypeError:
            return make()
        if found is None:
            found = make()
            with self._lock:
                while len(self._values) >= self.keep:
                    self._values.pop(next(iter(self._values)))
                self._values[key] = found
        return found  # type: ignore[return-value]
