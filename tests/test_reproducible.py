"""The same seed gives the same results.json; another seed does not."""

from __future__ import annotations

import json

import pytest
from helpers import strip_timing


def test_same_seed_same_results(tiny_config, tmp_path):
    from fedaval.api import run_training

    a = run_training(tiny_config(out=str(tmp_path / "a"), seed=3))
    b = run_training(tiny_config(out=str(tmp_path / "b"), seed=3))
    c = run_training(tiny_config(out=str(tmp_path / "c"), seed=4))
    on_disk = json.loads((tmp_path / "a" / "results.json").read_text())
    assert strip_timing(on_disk) == strip_timing(json.loads(json.dumps(a)))
    assert strip_timing(a) == strip_timing(b)
    assert strip_timing(a)["rounds"] != strip_timing(c)["rounds"]


def test_a_client_scope_switches_numpy_to_the_clients_own_generator(tiny_config, monkeypatch):
    """Inside ``client.rng_scope()`` every global stream (Python, NumPy,
    torch) continues the client's own, whatever is drawn outside between its
    scopes, and the run's streams continue as if the scope never happened.
    NumPy's is switched by bit generator, not copied out and in with
    ``get_state``/``set_state``; a client saved with NumPy's legacy state
    tuple (earlier versions) continues the same stream."""
    import random

    import numpy as np
    import torch

    from fedaval.build import build_run

    def draw():
        return random.random(), float(np.random.random_sample()), float(torch.rand(()))

    run = build_run(tiny_config())
    client = run.clients[0]
    legacy = dict(client.rng)  # NumPy's as a legacy state tuple until the client's first scope

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    outside_alone = [draw() for _ in range(3)]

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    outside, inside = [], []
    for _ in range(3):
        with monkeypatch.context() as m:
            m.setattr(np.random, "get_state", lambda *a, **k: pytest.fail("a scope copied NumPy's state"))
            m.setattr(np.random, "set_state", lambda *a, **k: pytest.fail("a scope copied NumPy's state"))
            with client.rng_scope():
                inside.append(draw())
        outside.append(draw())
    assert outside == outside_alone

    client.rng = legacy
    with client.rng_scope():
        again = [draw() for _ in range(3)]
    assert again == inside


def test_a_scope_that_keeps_no_draws_leaves_the_clients_streams_as_they_were(tiny_config):
    """``rng_scope(keep_draws=False)`` (an idle client's extra evaluation):
    the next scope draws what it would have drawn without it, NumPy's bit
    generator (advanced in place) included, and the run's streams go on."""
    import random

    import numpy as np
    import torch

    from fedaval.build import build_run

    def draw():
        return random.random(), float(np.random.random_sample()), float(torch.rand(()))

    run = build_run(tiny_config())
    client = run.clients[0]
    with client.rng_scope():
        draw()  # NumPy's stream is a bit generator object, advanced in place, from here on
    with client.rng_scope(keep_draws=False):
        first = draw()
    with client.rng_scope():
        assert draw() == first  # the scope that kept nothing left the streams where they were
