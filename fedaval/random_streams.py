"""The random streams of a run and of each client: the global generators'
states (Python's, NumPy's legacy one, torch's CPU and the run's CUDA
device), each client's own seeded from the run's seed and its id, and the
swap that makes a client's the global ones while it runs
(:meth:`fedaval.client.Client.rng_scope`; :mod:`fedaval.stacked` swaps them
at every step of a client in lockstep)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from numpy.random.mtrand import get_bit_generator, set_bit_generator


def rng_state(device: torch.device) -> dict[str, Any]:
    """A copy of the global random states: Python, NumPy, torch CPU and ``device`` if CUDA."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: dict[str, Any], device: torch.device) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def swap_streams(streams: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Make ``streams`` (a client's, from :func:`client_rng`) the global
    random streams and return the ones they replace, in the same form.

    Python's and torch's states are copied in and out. NumPy's legacy global
    generator (``np.random.*``) is switched to the client's own MT19937 bit
    generator object, which then advances in place
    (``np.random.set_bit_generator``, about 1 microsecond): copying its 2.5 KB
    state out and in with ``get_state``/``set_state`` took 0.2 to 0.4 ms per
    client scope here, two scopes per client and round (docs/performance.md).
    Switching the bit generator empties the legacy generator's cache of one
    normal deviate (NumPy's legacy ``normal`` draws them in pairs), so a scope
    starts without one; the draws are otherwise the same. fedaval draws
    nothing from ``np.random``; a plugin that draws legacy normals an odd
    number of times per scope gets a different, still reproducible, sequence
    than it would if the cache were carried over."""
    previous = current_streams(device)
    random.setstate(streams["python"])
    set_bit_generator(numpy_bit_generator(streams["numpy"]))
    torch.set_rng_state(streams["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(streams["cuda"], device)
    return previous


def current_streams(device: torch.device) -> dict[str, Any]:
    """The global random streams in the form :func:`swap_streams` returns
    them (NumPy's legacy generator's bit generator itself, not a copy)."""
    streams = {"python": random.getstate(), "numpy": get_bit_generator(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        streams["cuda"] = torch.cuda.get_rng_state(device)
    return streams


def copy_streams(streams: dict[str, Any]) -> dict[str, Any]:
    """A copy of a client's streams (:func:`client_rng`) that later draws do
    not change: NumPy's bit generator advances in place, so it is copied; the
    other states are values, replaced rather than changed by a scope."""
    copy = dict(streams)
    if isinstance(copy["numpy"], np.random.MT19937):
        copy["numpy"] = np.random.MT19937()
        copy["numpy"].state = streams["numpy"].state
    return copy


def numpy_bit_generator(state: Any) -> np.random.MT19937:
    """``state`` as an MT19937 bit generator: itself, or a new one in the
    state of NumPy's legacy state tuple, which a client keeps until its first
    scope (:func:`client_rng`; clients saved by earlier versions too). Made
    there rather than when the client is built: making one costs about as much
    as the four state copies it saves (0.1 to 0.2 ms), and a client that never
    trains never needs one."""
    if isinstance(state, np.random.MT19937):
        return state
    bit_generator = np.random.MT19937()
    bit_generator.state = {"bit_generator": "MT19937", "state": {"key": state[1], "pos": state[2]}}
    return bit_generator


def client_rng(seed: int, client_id: int, device: torch.device) -> dict[str, Any]:
    """Client ``client_id``'s initial random states, derived from the run's
    seed: the states the global generators have after being seeded with it
    (NumPy's as its legacy state tuple, :func:`numpy_bit_generator`)."""
    outside = rng_state(device)
    client_seed = int(np.random.SeedSequence([seed, client_id]).generate_state(1)[0])
    random.seed(client_seed)
    np.random.seed(client_seed)
    if device.type == "cuda":
        torch.manual_seed(client_seed)
    else:  # the CPU generator only: torch.manual_seed also queues a seed for CUDA, capturing the stack (~1 ms)
        torch.default_generator.manual_seed(client_seed)
    try:
        return rng_state(device)
    finally:
        set_rng_state(outside, device)
