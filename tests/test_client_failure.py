"""--on-client-failure: a client that raises or goes non-finite is dropped, or stops the run."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from helpers import Raises

from fedaval import hookimpl
from fedaval.cli import cli
from fedaval.errors import RunFailure


class GoesNaN:
    """Client 1's loss is NaN in round 2, so its weights become NaN."""

    name = "goesnan"

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        if client.id == 1 and run.round == 2:
            return {"poison": batch.loss * float("nan")}
        return {}


class Probe:
    """Records which clients' uploads reach fusion, and the global weights after it."""

    name = "probe"

    def __init__(self):
        self.fused: dict[int, list[int]] = {}
        self.finite: dict[int, bool] = {}

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        self.fused[round] = [u.client_id for u in uploads]

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        self.finite[round] = all(
            bool(torch.isfinite(v).all()) for v in run.server.model.state_dict().values() if v.is_floating_point()
        )
        return {}


@pytest.mark.parametrize("failing", [Raises, GoesNaN], ids=["raises", "nan"])
def test_drop_leaves_the_client_out_of_that_round_only(tiny_config, tmp_path, caplog, failing):
    from fedaval.api import run_training

    probe = Probe()
    with caplog.at_level(logging.WARNING, logger="fedaval"):
        results = run_training(tiny_config(eval_every=1), extra_plugins=[failing(), probe])
    assert probe.fused == {1: [0, 1], 2: [0], 3: [0, 1], 4: [0, 1]}
    assert all(probe.finite.values()) and len(probe.finite) == 4
    rounds = results["rounds"]
    assert [len(r["failed_clients"]) for r in rounds] == [0, 1, 0, 0]
    failure = rounds[1]["failed_clients"][0]
    assert failure["client"] == 1
    expected = "disk full on client 1" if failing is Raises else "is nan"
    assert expected in failure["reason"]
    assert results["final"]["failed_clients"] == 1
    assert all(math.isfinite(v) for r in rounds for v in r["losses"].values())
    assert "round 2: client 1 left out of fusion" in caplog.text and expected in caplog.text
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["rounds"][1]["failed_clients"] == rounds[1]["failed_clients"]


@pytest.mark.parametrize("failing", [Raises, GoesNaN], ids=["raises", "nan"])
def test_fail_stops_with_one_line_and_a_checkpoint_to_resume_from(tiny_config, tmp_path, failing):
    from fedaval import checkpoint
    from fedaval.api import run_training

    with pytest.raises(RunFailure) as info:
        run_training(tiny_config(on_client_failure="fail"), extra_plugins=[failing()])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("client 1 failed in round 2: ")
    assert f"resume from round 1 with: fedaval train --resume {tmp_path / 'run'}" in message
    assert [r for r, _ in checkpoint.saved(tmp_path / "run")] == [1]
    assert len(json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]) == 1


def test_every_client_failing_stops_even_under_drop(tiny_config):
    from fedaval.api import run_training

    class AllRaise:
        @hookimpl
        def fedaval_client_upload(self, run, client):
            raise ValueError(f"bad upload from {client.id}")

    with pytest.raises(
        RunFailure, match=r"all 2 sampled clients failed in round 1; first: ValueError: bad upload from 0"
    ):
        run_training(tiny_config(), extra_plugins=[AllRaise()])


def test_non_finite_fusion_never_reaches_the_global_model(tiny_config):
    from fedaval.build import build_run
    from fedaval.coordinator import train

    class BadFusion:
        @hookimpl
        def fedaval_server_fuse_weights(self, run, uploads, global_weights):
            return {k: torch.full_like(v, float("inf")) for k, v in global_weights.items()}

    run = build_run(tiny_config(), extra_plugins=[BadFusion()])
    before = {k: v.clone() for k, v in run.server.model.state_dict().items()}
    with pytest.raises(RunFailure, match="round 1: fused weights.* holds non-finite values"):
        train(run)
    after = run.server.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


PLUGIN = """
from fedaval import hookimpl


class Flaky:
    name = "flaky"

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if client.id == 0 and run.round == 3:
            raise RuntimeError("GPU fell off the bus")
"""


def test_cli_policies(tmp_path, monkeypatch):
    (tmp_path / "flaky_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flaky_plugin", raising=False)
    base = [
        "train",
        "--quiet",
        "--plugins",
        "fedavg,flaky_plugin:Flaky",
        "--rounds-per-task",
        "2",
        "-o",
        "fcil-sync.clients=2",
        "-o",
        "fcil-sync.tasks=2",
    ]
    runner = CliRunner()

    dropped = runner.invoke(cli, [*base, "--out", str(tmp_path / "drop")])
    assert dropped.exit_code == 0, dropped.output
    assert "failed clients: 1" in dropped.output
    results = json.loads((tmp_path / "drop" / "results.json").read_text())
    [failure] = results["rounds"][2]["failed_clients"]
    assert failure["client"] == 0  # the reason names where the plugin raised it (the core's frames passed over)
    assert re.fullmatch(
        r"RuntimeError: GPU fell off the bus \(raised at [^ ]+/flaky_plugin\.py:\d+ in fedaval_client_epoch_start\)",
        failure["reason"],
    )

    failed = runner.invoke(cli, [*base, "--on-client-failure", "fail", "--out", str(tmp_path / "fail")])
    assert failed.exit_code == 1
    lines = [line for line in failed.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "fedaval: run stopped: client 0 failed in round 3: RuntimeError: GPU fell off the bus (raised at "
    )
    assert lines[0].endswith(
        f"in fedaval_client_epoch_start); resume from round 2 with: fedaval train --resume {tmp_path / 'fail'}"
    )


def test_check_finite_names_the_first_bad_entry_and_reads_each_device_once(monkeypatch):
    """Every tensor's answer is read back in one transfer per device (on a GPU
    each read waits for the device), and the error still names the first
    non-finite entry in the payload's order, tensor or number."""
    from fedaval.payload import check_finite

    good = {"weights": {f"layer{i}": torch.randn(3) for i in range(50)}, "count": 4, "scale": 0.5}
    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real, _name=name: reads.append(_name) or _real(self, *a)
        )
    check_finite(good, "upload")
    assert reads == ["tolist"]
    bad = {
        "a": [torch.ones(2), {"b": torch.tensor([1.0, float("nan")])}],
        "c": float("inf"),
        "d": torch.full((2,), float("inf")),
    }
    with pytest.raises(FloatingPointError, match=r"^upload\['a'\]\[1\]\['b'\] holds non-finite values$"):
        check_finite(bad, "upload")
    with pytest.raises(FloatingPointError, match=r"^upload\['c'\] holds inf$"):
        check_finite({"c": float("inf"), "d": torch.full((2,), float("nan"))}, "upload")
    check_finite({"n": torch.arange(3), "s": "text", "none": None}, "upload")  # integer tensors are not checked


def test_check_finite_over_mixed_dtypes_keeps_the_payload_order():
    """Tensors are checked per device and dtype together; the error still
    names the first bad entry in the payload's order, whatever its dtype,
    and empty or non-contiguous tensors are checked as any other."""
    from fedaval.payload import check_finite

    big = torch.randn(1000)
    big[500] = float("nan")
    strided = torch.zeros(4, 3).t()
    strided[2, 1] = float("-inf")
    payload = {
        "a": torch.ones(3, dtype=torch.float64),
        "empty": torch.empty(0),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "c": big,
        "d": torch.tensor([float("inf")], dtype=torch.float64),
    }
    with pytest.raises(FloatingPointError, match=r"^upload\['c'\] holds non-finite values$"):
        check_finite(payload, "upload")
    with pytest.raises(FloatingPointError, match=r"^upload\['s'\] holds non-finite values$"):
        check_finite({"h": torch.ones(2, dtype=torch.float16), "s": strided}, "upload")
    check_finite({"a": payload["a"], "empty": payload["empty"], "b": payload["b"]}, "upload")


class CountReads:
    """Counts what reads a tensor's values back to the host (each a wait for the
    device on a GPU) while it is active. Torch's data loader and samplers are
    not counted: their random draws are host tensors on every device."""

    NAMES = ("__bool__", "__float__", "__int__", "item", "tolist", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.reads: list[str] = []
        self.active = False
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, _name=name, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if self.active and "torch/utils/data/" not in caller.replace("\\", "/"):
                    self.reads.append(_name)
                return _real(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_in_process_backend_reads_the_device_once_per_round_not_per_client(tiny_config, monkeypatch):
    """Reading a client's loss terms and its upload's check after each client
    made a GPU idle while the host set up the next one; now a round's clients
    are read together, once, after the last (docs/performance.md, item 3)."""
    from fedaval.backends import LocalBackend
    from fedaval.build import build_run
    from fedaval.coordinator import client_extras

    run = build_run(tiny_config(scenario_options={"clients": 4, "tasks": 2}, checkpoint_every=0))
    counter = CountReads(monkeypatch)
    backend = LocalBackend()
    run.server.begin_task(0)
    for round in (1, 2):
        run.enter_round(round)
        download = run.server.download()
        sampled = run.schedule[round - 1]
        extras = {k: client_extras(run, k, download) for k in sampled}
        counter.active = True
        results = backend.train_clients(run, sampled, download, round, extras)
        counter.active = False
        run.server.fuse([r.upload for r in results], round)
        assert len(results) == 4 and all(r.failure is None for r in results)
        assert counter.reads == ["tolist"], f"round {round}"  # one device: one read for the 4 clients
        counter.reads.clear()
        for result in results:  # settled: plain floats, the means of the round's loss terms
            assert result.pending is None
            assert {type(v) for v in result.losses.values()} == {float}
            assert set(result.losses) == {"loss/classification", "loss/total"}


class NaNFirst:
    """Client 0's loss is NaN in round 2; with ``upload_raises`` its upload hook then raises too."""

    name = "nanfirst"

    def __init__(self, upload_raises: bool):
        self.upload_raises = upload_raises
        self.uploads: list[tuple[int, int]] = []

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        if client.id == 0 and run.round == 2:
            return {"poison": batch.loss * float("nan")}
        return {}

    @hookimpl
    def fedaval_client_upload(self, run, client):
        self.uploads.append((run.round, client.id))
        if self.upload_raises and client.id == 0 and run.round == 2:
            raise ValueError("cannot summarise NaN features")
        return {}


@pytest.mark.parametrize("upload_raises", [False, True])
def test_a_non_finite_loss_is_the_failure_named_when_read_after_the_round(tiny_config, upload_raises):
    """Read after every client of the round has run, client 0's NaN loss still
    fails it alone, and the reason names the loss term: the loss terms are
    checked before the upload, also when its upload hooks (which now run
    before the check) raise on the NaN model."""
    from fedaval.api import run_training

    plugin, probe = NaNFirst(upload_raises), Probe()
    results = run_training(
        tiny_config(scenario_options={"clients": 3, "tasks": 2}, checkpoint_every=0), extra_plugins=[plugin, probe]
    )
    assert probe.fused[2] == [1, 2] and probe.fused[3] == [0, 1, 2]
    failed = results["rounds"][1]["failed_clients"]
    assert [f["client"] for f in failed] == [0]
    # the first term in order: the weights are NaN after its first step, so the classification loss is too
    assert failed[0]["reason"] == "FloatingPointError: loss/classification is nan"
    assert (2, 0) in plugin.uploads  # its upload hooks ran; the upload was dropped
    assert all(math.isfinite(v) for r in results["rounds"] for v in r["losses"].values())


def test_settle_reads_every_client_together_and_fails_only_the_bad_ones():
    """Three clients' rounds read at once: loss means held as tensors become
    floats; a non-finite upload fails its client alone, named by its first
    bad entry; a float loss term is checked as a tensor one is."""
    from fedaval.backends.local import ClientRound, settle
    from fedaval.payload import FiniteCheck, Upload

    def pending(client_id, losses, entries):
        return ClientRound(
            client_id, losses=losses, upload=Upload(client_id, 10, entries), pending=FiniteCheck(entries, "upload")
        )

    good = pending(0, {"loss/total": torch.tensor(0.25, dtype=torch.float64)}, {"w": torch.ones(3)})
    bad_upload = pending(1, {"loss/total": torch.tensor(0.5)}, {"w": torch.ones(2), "b": torch.tensor([1.0, math.inf])})
    bad_float = pending(2, {"loss/total": torch.tensor(0.5), "loss/extra": math.nan}, {"w": torch.ones(2)})
    already = ClientRound(3, failure="RuntimeError: earlier")
    settle([good, bad_upload, bad_float, already])
    assert good.failure is None and good.losses == {"loss/total": 0.25} and good.pending is None
    assert bad_upload.failure == "FloatingPointError: upload['b'] holds non-finite values"
    assert bad_upload.upload is None and bad_upload.losses == {}
    assert bad_float.failure == "FloatingPointError: loss/extra is nan"
    assert already.failure == "RuntimeError: earlier"


class FailsToReceive:
    """Client 1's receive fails in round 4, its first of stage 2 (3 rounds a
    stage); records the task starts and client 1's test classes at the end."""

    name = "fails-to-receive"

    def __init__(self):
        self.task_starts: list[tuple[int, int, int]] = []  # (round, client, task)
        self.tested: set[int] = set()

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if client.id == 1 and run.round == 4:
            raise RuntimeError("link dropped")

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        self.task_starts.append((run.round, client.id, task))

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        if round == run.total_rounds:
            self.tested = {int(y) for e in run.clients[1].seen_test_experiences() for y in e.dataset.targets}
        return {}


def test_a_client_that_fails_before_its_first_round_of_a_stage_begins_the_stage_in_its_next(tiny_config):
    """Its next round is then its first of the stage: the task-start hooks run,
    and the stage's classes are among those it is tested on."""
    from fedaval.api import run_training

    probe = FailsToReceive()
    results = run_training(
        tiny_config(rounds_per_task=3, scenario_options={"clients": 2, "tasks": 2}), extra_plugins=[probe]
    )
    assert [f["client"] for f in results["rounds"][3]["failed_clients"]] == [1]
    assert (4, 0, 1) in probe.task_starts and (5, 1, 1) in probe.task_starts
    client_1 = results["scenario"]["client_task_classes"][1]
    assert probe.tested == set(client_1[0]) | set(client_1[1])
