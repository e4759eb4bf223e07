"""A cache of values made from objects, kept by the objects' identity.

Evaluation remakes, for every seen experience after every round, things that
never change for that experience (its dataset's eval view, its logging copy,
its metric names: ``docs/performance.md``, "Fixed cost per round"). An
:class:`ObjectCache` keeps them by experience object instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: At most this many objects' values are kept per cache (all are dropped when
#: it is full): a run evaluates a few experience objects per task; something
#: making new objects every round would otherwise make a cache grow with the
#: rounds done.
MAX_OBJECTS = 1024


class ObjectCache:
    """``obj`` -> the value ``make(obj)`` gave, by identity. Each entry holds
    its object, so the object's ``id`` is not reused while the entry exists.
    Owners that are pickled leave their cache out (it is rebuilt on use)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, Any]] = {}

    @staticmethod
    def of(owner: Any, attribute: str) -> ObjectCache:
        """``owner``'s cache in ``attribute``, made there on first use (an owner
        unpickled without one gets one)."""
        cache = owner.__dict__.get(attribute)
        if cache is None:
            cache = owner.__dict__[attribute] = ObjectCache()
        return cache

    def get(self, obj: Any, make: Callable[[Any], Any], valid: Callable[[Any], bool] | None = None) -> Any:
        """The value kept for ``obj``, or ``make(obj)`` (then kept) when there
        is none or ``valid(value)`` says the kept one no longer applies."""
        entry = self._entries.get(id(obj))
        if entry is not None and entry[0] is obj and (valid is None or valid(entry[1])):
            return entry[1]
        if len(self._entries) >= MAX_OBJECTS:
            self._entries.clear()
        value = make(obj)
        self._entries[id(obj)] = (obj, value)
        return value
