"""Per-client plugin state: ``client.stash``, typed keys owned by plugins.

Modelled on pytest's ``Stash``: a plugin makes a module-level
:class:`StashKey` per piece of per-client state and reads and writes it on
the client::

    TEACHER = StashKey[nn.Module]("mymethod.teacher")

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        client.stash[TEACHER] = copy.deepcopy(client.model)

Because the state lives on the client, it goes wherever the client goes:
offloaded to memory or disk (:mod:`fedaval.offload`), sent to a Ray worker
and back (:mod:`fedaval.backends.transfer`), saved in a checkpoint. The stash
stores each entry under its key's ``name`` (by convention
``<plugin name>.<what>``), so the state is found again in another process
or after a resume, where the key objects are new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Stash", "StashKey"]

T = TypeVar("T")


class StashKey(Generic[T]):
    """A key of :class:`Stash`; its type parameter is the type of its value.
    ``name`` identifies the key across processes and checkpoints: make one
    key per piece of state, as a module-level constant."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """A client's per-plugin state: ``stash[key]``, ``key in stash``,
    ``stash.get(key, default)``, ``stash.setdefault(key, factory)``,
    ``del stash[key]``, ``stash.pop(key, default)``."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._values[key.name] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return self._values[key.name]

    def get(self, key: StashKey[T], default: Any = None) -> T | Any:
        return self._values.get(key.name, default)

    def setdefault(self, key: StashKey[T], factory: Callable[[], T]) -> T:
        """The value of ``key``, set to ``factory()`` first if it has none."""
        if key.name not in self._values:
            self._values[key.name] = factory()
        return self._values[key.name]

    def pop(self, key: StashKey[T], default: Any = None) -> T | Any:
        return self._values.pop(key.name, default)

    def __delitem__(self, key: StashKey[T]) -> None:
        del self._values[key.name]

    def __contains__(self, key: StashKey[T]) -> bool:
        return key.name in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __getstate__(self) -> dict[str, Any]:
        return {"_values": self._values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._values = state["_values"]
