"""benchmarks/pfl_overhead.py runs, and fedaval and pfl do the same work (tiny
settings; no timing is asserted). pfl is a benchmark-only dependency in its own
environment (the ``pfl`` extra), which CI does not install: skipped without it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pfl")
pytestmark = pytest.mark.slow  # whole trainings, on both sides

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_pfl_benchmark_does_the_same_work_as_fedaval(cifar10_root, monkeypatch, capsys):
    """The repository's CIFAR-10 subset (uint8 images, the ``cnn`` with its
    BatchNorm statistics): two tasks with every client every round, and
    cross-device sampling of 5 of 10 clients. With ``--exact`` pfl's final
    global model equals fedaval's bit for bit; with pfl's own float32
    aggregation it is within float tolerance. In this process (torch is
    imported already), which keeps the test under 20 s on a busy 2-core machine."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pfl_overhead

    args = ["--dataset", "imagefolder", "--data-root", str(cifar10_root), "--model", "cnn", "--repeats", "1"]
    args += ["--shapes", "short-tasks,cross-device", "--tasks", "2", "--rounds-per-task", "1"]
    args += ["--cd-clients", "10", "--cd-per-round", "5", "--cd-rounds", "2", "--exact", "--in-process"]
    assert pfl_overhead.main(args) == 0
    out = capsys.readouterr().out
    rows = {
        cells[1].strip(): [c.strip() for c in cells]
        for cells in (line.split("|") for line in out.splitlines() if line.startswith("| "))
    }
    for shape in ("short-tasks", "cross-device"):
        assert rows[shape][8] == "0.00e+00", out  # --exact: fedaval's arithmetic, the same work
        assert float(rows[shape][7]) < 1e-4, out  # pfl's float32 FedAvg
        assert float(rows[shape][4].strip("*")) > 0, out  # the ratio fedaval / pfl
