"""Counting the ATen operations a piece of code runs, by the file that ran them.

On a GPU each ATen operation is at least one kernel launch (unless a CUDA
graph replays it), and a launch costs the host several microseconds however
small the kernel: when the host bounds a step or a round, the count is what
to cut. The count is the same on the CPU, so it can be taken there
(``step_host.py --count-ops``, ``overhead.py --count-ops``)."""

from __future__ import annotations

import collections
import sys
import sysconfig
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent


def _roots() -> list[tuple[str, str]]:
    """(path prefix, label) of the code counted by file: fedaval, Avalanche, these benchmarks."""
    import avalanche

    import fedaval

    return [
        (str(Path(fedaval.__file__).resolve().parent) + "/", "fedaval/"),
        (str(Path(avalanche.__file__).resolve().parent) + "/", "avalanche/"),
        (str(HERE) + "/", "benchmarks/"),
    ]


NO_KERNEL = ("empty.", "empty_like.", "empty_strided.", "set_.", "_unsafe_view.")
"""Operations that only allocate or relabel memory (with every view: ``OpOverload.is_view``): no kernel on a GPU."""


def launches_kernel(func) -> bool:
    """Whether ATen operation ``func`` runs a kernel on a GPU (an estimate:
    views, allocations and the profiler's markers do not; a copy to the
    host is counted, as a transfer)."""
    return func.namespace == "aten" and not func.is_view and not func.__name__.startswith(NO_KERNEL)


class OpCount(TorchDispatchMode):
    """Counts the ATen operations run inside it, by the innermost fedaval,
    Avalanche or benchmark file on the Python stack that ran each
    (``fedaval/strategy.py``); ``other`` where there is none (a GPU's
    backward, which runs on autograd's own thread). Use it as a context
    manager; ``by_file`` holds the counts, ``launches`` those of the
    operations that run a kernel on a GPU (:func:`launches_kernel`)."""

    def __init__(self):
        super().__init__()
        self.by_file: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self._roots = _roots()
        self._places: dict[str, str | None] = {}  # a code object's file -> its label (None: not counted)
        self._stdlib = sysconfig.get_paths()["stdlib"]

    def _label(self, filename: str) -> str | None:
        label = self._places.get(filename, "")
        if label == "":
            path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
            label = next((name + Path(path).name for root, name in self._roots if path.startswith(root)), None)
            self._places[filename] = label
        return label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        where = "other"
        while frame is not None:
            label = self._label(frame.f_code.co_filename)
            if label is not None:
                where = label
                break
            frame = frame.f_back
        self.by_file[where] += 1
        if launches_kernel(func):
            self.launches[where] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.by_file.values())

    def total_launches(self) -> int:
        return sum(self.launches.values())

    def table(self, per: float, top: int = 12) -> str:
        """The operations that launch a kernel, divided by ``per`` (steps,
        rounds), by file, largest first: ``file n, ...``."""
        return ", ".join(f"{where} {n / per:.1f}" for where, n in self.launches.most_common(top))

    def summary(self, per: float, unit: str) -> str:
        """``N operations a UNIT, M of them kernels (by file: ...)``."""
        return (
            f"{self.total() / per:,.1f} operations a {unit}, {self.total_launches() / per:,.1f} of them kernels "
            f"({self.table(per)})"
        )
