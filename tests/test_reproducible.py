"""The same seed gives the same results.json; another seed does not."""

from __future__ import annotations

import json

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
