"""``--client-streams K``: a round's clients issued on K CUDA streams of one
process, so that the GPU may run several clients' kernels side by side
(the GPU issue's item 3: "clients trained concurrently on one GPU ... CUDA
streams sharing it").

The in-process backend trains a round's clients one after another, and
since one read per round (:func:`fedaval.backends.local.settle`) the host
does not wait for the GPU between them: it queues a client's work and goes
on to the next. On one stream the GPU still runs that queue in order, one
small kernel (or one step's graph) at a time, and a batch of 32 leaves most
of a GPU's multiprocessors idle. With K streams the ``i``-th client of the
round is issued on stream ``i mod K``; kernels of different streams of one
process may run at once (worker processes cannot: without MPS the GPU
time-slices between their contexts, docs/performance.md, item 3).

What keeps the results those of the clients trained one after another:

* each client's work is issued from the host in the same order as without
  streams, so the same kernels run with the same arguments and the same
  random numbers (the clients' random streams and the device generator's
  offsets are the host's); only when they run changes. With
  ``--deterministic`` a run gives the same results.json as without streams;
  without it cuDNN's autotuning may time its candidates while other
  clients' kernels run and pick others, as it may from run to run anyway;
* before a client's work the stream waits for the default stream (the
  global weights, the server's fusion, evaluation); after the round's last
  client the default stream waits for every stream, before anything reads
  what the clients made (the loss terms and upload checks read once a
  round, the uploads fused on the default stream);
* a client's tensors are used by its own stream within a round; memory a
  client frees is reused by the allocator on the stream that allocated it,
  which is ordered after that stream's earlier work; tensors made on one
  stream and used on the default stream (uploads, loss terms) are freed
  only after the default stream has waited for it.

CUDA only; the in-process backend only (Ray's workers each hold a client's
round in a process of their own). ``K = 1`` (the default) issues every
client on the default stream, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from fedaval.errors import FedavalUsageError

if TYPE_CHECKING:
    from fedaval.config import RunConfig


def check(config: RunConfig, device: torch.device) -> None:
    """``--client-streams`` above 1 needs a CUDA device and the in-process backend: one-line errors."""
    k = config.client_streams
    if k == 1:
        return
    if device.type != "cuda":
        raise FedavalUsageError(
            f"--client-streams {k} needs a CUDA device; --device {config.device} is {device.type}: "
            "use --client-streams 1 or a GPU"
        )
    config.needs_local_backend(f"--client-streams {k}")


@functools.cache
def _streams(device: torch.device, k: int) -> tuple[torch.cuda.Stream, ...]:
    """The process's ``k`` client streams on ``device``, made once."""
    return tuple(torch.cuda.Stream(device) for _ in range(k))


class ClientStreams:
    """A round's clients on ``k`` streams of ``device``: enter :meth:`client`
    around the ``i``-th client's work, call :meth:`join` after the last one."""

    def __init__(self, device: torch.device, k: int):
        self.streams = _streams(device, k) if k > 1 else ()
        self.device = device
        self._used: set[int] = set()

    def client(self, index: int):
        """The ``index``-th client's stream, entered after it waits for the current stream."""
        if not self.streams:
            return nullcontext()
        return self._on(index % len(self.streams))

    @contextmanager
    def _on(self, slot: int) -> Iterator[None]:
        stream = self.streams[slot]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._used.add(slot)
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        """The current stream waits for every stream a client was issued on."""
        if not self._used:
            return
        current = torch.cuda.current_stream(self.device)
        for slot in sorted(self._used):
            current.wait_stream(self.streams[slot])
        self._used.clear()
