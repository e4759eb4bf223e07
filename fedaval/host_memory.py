"""``--host-memory keep|release``: what the C library does with freed host memory.

A CPU tensor is one ``malloc`` block. glibc serves a block above its mmap
threshold (128 KiB at first, rising with use to at most 32 MiB) with its own
``mmap`` and gives it back to the system when it is freed, and it trims the
free top of its heap back to the system as well. Training and evaluation make
and free the same large activations every minibatch (a batch of 256 CIFAR-10
images through the ``cnn``'s first convolution: 33.5 MB), so each time the
kernel maps and zeroes those pages again. On the CIFAR-10 ``cnn`` workload of
``benchmarks/overhead.py`` that is 2.5 to 3.1 million page faults and 6.5 to 8
s of kernel time in a 45 to 55 s run, 13% of the time
(``benchmarks/host_memory.py``; docs/performance.md, "Host memory").

``keep`` (the default): glibc's ``mallopt`` serves every block from the heap
(``M_MMAP_MAX`` 0) and never trims it (``M_TRIM_THRESHOLD`` at its maximum),
so freed blocks are reused as they are. The process's resident memory stays at
its peak until it exits. ``release``: glibc's own policy; when an earlier run
in this process kept memory, glibc's documented starting values are restored
(mmap and trim thresholds of 128 KiB, at most 65,536 mmapped blocks), since
its adaptive threshold cannot be switched back on; blocks already free in the
heap stay there and are reused first.

The setting belongs to the process, not the run: it is applied when a run is
built (:func:`fedaval.build.build_run`, in Ray workers too). Results never
depend on it; only time and resident memory do. On a C library without glibc's
``mallopt`` (macOS, Windows, musl) ``keep`` cannot be applied, and the run
logs a warning saying so.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from fedaval.config import HOST_MEMORY as CHOICES

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
# glibc's documented starting values (mallopt(3)), restored by "release" after "keep"
DEFAULT_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
INT_MAX = 2**31 - 1

_kept = False  # whether this process's C library was told to keep freed memory


@functools.cache
def _mallopt():
    """glibc's ``mallopt``, or ``None`` where the C library has none (or a stub);
    looked up once per process, in the symbols the process already has loaded."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt is a stub
    except (OSError, AttributeError, TypeError):  # TypeError: Windows takes no CDLL(None)
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def apply(choice: str) -> bool:
    """Apply ``choice`` (one of :data:`CHOICES`) to this process; returns
    whether the C library's policy was changed."""
    global _kept
    if choice not in CHOICES:
        raise ValueError(f"host memory policy {choice!r}; allowed: {', '.join(CHOICES)}")
    if _kept == (choice == "keep"):
        return False  # already so: kept, or the C library's own policy untouched
    mallopt = _mallopt()
    if mallopt is None:
        logging.getLogger("fedaval").warning(
            "--host-memory keep: this C library has no glibc mallopt; freed host memory is handled as it decides"
        )
        return False
    settings: list[tuple[int, int]]
    if choice == "keep":
        settings = [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, INT_MAX)]
    else:
        settings = [
            (M_MMAP_MAX, DEFAULT_MMAP_MAX),
            (M_MMAP_THRESHOLD, DEFAULT_THRESHOLD),
            (M_TRIM_THRESHOLD, DEFAULT_THRESHOLD),
        ]
    if not all(mallopt(option, value) == 1 for option, value in settings):
        logging.getLogger("fedaval").warning("--host-memory %s: the C library refused the setting", choice)
        return False
    _kept = choice == "keep"
    return True
