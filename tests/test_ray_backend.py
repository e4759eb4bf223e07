"""``--backend ray``: the same seed gives the same results as in-process, on a
local Ray instance with 2 CPUs; checkpoints, failures and user errors."""

from __future__ import annotations

import json
import re
import socket
import sys
import warnings

import pytest
from click.testing import CliRunner
from helpers import Raises, one_line_error, strip_timing

from fedaval import hookimpl
from fedaval.cli import cli
from fedaval.errors import RunFailure

pytestmark = pytest.mark.slow  # whole trainings

ray = pytest.importorskip("ray")  # in the test extra; CI installs it

FAST = ["-o", "fcil-sync.clients=2", "-o", "fcil-sync.tasks=2", "--rounds-per-task", "1", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance with 2 CPUs for the session. The plugin classes
    of this module and of helpers.py go to the workers by value (they cannot
    import tests/)."""
    from fedaval.backends.ray import shutdown_workers

    for module in (sys.modules[__name__], sys.modules["helpers"]):
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    shutdown_workers()
    ray.shutdown()


def comparable(results: dict) -> dict:
    """results.json without timings, the run folder and the backend's own options."""
    out = strip_timing(results)
    for key in ("backend", "client_gpus", "ray_address"):
        out["config"].pop(key, None)
    return out


def assert_close(local, remote, where="results"):
    """Equal structure and values; floats within float tolerance."""
    if isinstance(local, dict):
        assert isinstance(remote, dict) and local.keys() == remote.keys(), where
        for key in local:
            assert_close(local[key], remote[key], f"{where}[{key!r}]")
    elif isinstance(local, (list, tuple)):
        assert isinstance(remote, (list, tuple)) and len(local) == len(remote), where
        for i, (a, b) in enumerate(zip(local, remote)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(local, float) and isinstance(remote, float):
        assert remote == pytest.approx(local, rel=1e-6, abs=1e-9), where
    else:
        assert local == remote, where


def both_backends(tiny_config, tmp_path, extra=(), **settings):
    from fedaval.api import run_training

    local = run_training(tiny_config(out=str(tmp_path / "local"), **settings), extra_plugins=list(extra))
    remote = run_training(tiny_config(out=str(tmp_path / "ray"), backend="ray", **settings), extra_plugins=list(extra))
    return local, remote


# --- same seed, same results ---------------------------------------------------
METHODS = {
    "fedavg": dict(plugins=["fedavg"]),
    "fedprox": dict(plugins=["fedprox"], plugin_options={"fedprox": {"mu": "0.1"}}),
    "fednova": dict(plugins=["fednova"], local_epochs=2, momentum=0.5),
    "gldp-sthfl": dict(
        plugins=["gldp"],
        scenario="sthfl",
        scenario_options={"clients": 3, "tasks": 2, "classes_per_task": 2},
        local_epochs=2,
        plugin_options={"gldp": {"predict": "local"}},
    ),
    "pfcl-fcl-random": dict(plugins=["pfcl"], scenario="fcl-random", scenario_options={"clients": 2}),
    "fedprok": dict(plugins=["fedprok"], local_epochs=2),
    "fedrep": dict(plugins=["fedrep"], local_epochs=2),
    "apfl": dict(plugins=["apfl"]),
    "fedlwf+fedreplay": dict(plugins=["fedlwf", "fedreplay"], plugin_options={"fedreplay": {"mem_size": "40"}}),
    "hgp": dict(
        plugins=["hgp"],
        plugin_options={
            "hgp": {
                "vit_patch": 4,
                "vit_dim": 32,
                "vit_depth": 2,
                "vit_heads": 2,
                "vit_mlp_dim": 64,
                "prompt_length": 3,
            }
        },
    ),
    # 2 of 4 clients per round: the others offloaded between rounds
    "sampled": dict(plugins=["fedavg"], clients_per_round=2, scenario_options={"clients": 4, "tasks": 2}),
}


@pytest.mark.parametrize("settings", list(METHODS.values()), ids=list(METHODS))
def test_ray_gives_the_in_process_results(ray_cluster, tiny_config, tmp_path, settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HGP's random-backbone warning
        local, remote = both_backends(tiny_config, tmp_path, **settings)
    assert remote["config"]["backend"] == "ray"
    assert_close(comparable(local), comparable(remote))


def test_tensorboard_is_the_same_on_both_backends(ray_cluster, tiny_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    both_backends(
        tiny_config,
        tmp_path,
        plugins=["gldp"],
        scenario="sthfl",
        scenario_options={"clients": 3, "tasks": 2, "classes_per_task": 2},
    )

    def scalars(folder):
        found = {}
        for path in sorted((folder / "tb").glob("events.out.tfevents.*")):
            acc = EventAccumulator(str(path))
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                if not tag.startswith("Fed/seconds"):
                    found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        return found

    local, remote = scalars(tmp_path / "local"), scalars(tmp_path / "ray")
    assert "Top1_Acc_Stream/eval_phase/test_stream/client002" in local
    assert local.keys() == remote.keys()
    for tag in local:
        assert [s for s, _ in local[tag]] == [s for s, _ in remote[tag]], tag
        assert [v for _, v in remote[tag]] == pytest.approx([v for _, v in local[tag]], rel=1e-6, abs=1e-9), tag


def test_the_backend_counts_what_it_sends(ray_cluster, tiny_config, tmp_path):
    from fedaval.backends import make_backend
    from fedaval.build import build_run
    from fedaval.coordinator import train

    run = build_run(tiny_config(backend="ray", out=None), out_dir=None)
    backend = make_backend(run)
    train(run, backend=backend)
    assert [t["round"] for t in backend.traffic] == [1, 2, 3, 4]
    for t in backend.traffic:
        assert t["clients"] == 2 and t["broadcast"] > 0
        assert t["to_workers"] > 0 and t["from_workers"] > t["to_workers"]  # the upload comes back too


# --- checkpoints -----------------------------------------------------------------
def test_a_ray_run_resumes_on_either_backend(ray_cluster, tiny_config, tmp_path):
    """Checkpoints hold the driver's clients, which are complete: a Ray run's
    checkpoint resumes with Ray or in-process, to the same results."""
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    settings = dict(
        plugins=["fedreplay"], plugin_options={"fedreplay": {"mem_size": "40"}}, rounds_per_task=2, keep_checkpoints=10
    )
    whole = comparable(run_training(tiny_config(out=str(tmp_path / "whole"), backend="ray", **settings)))
    for backend in ("ray", "local"):
        config = tiny_config(out=str(tmp_path / f"resumed-{backend}"), backend=backend, **settings)
        run = build_run(config, out_dir=tmp_path / f"resumed-{backend}")
        results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", 3))  # mid-task 2
        assert_close(whole, comparable(train(run, results=results)))


def test_resume_on_the_command_line(ray_cluster, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--backend", "ray", "--out", str(out), *FAST])
    assert result.exit_code == 0, result.output
    whole = comparable(json.loads((out / "results.json").read_text()))
    (out / "checkpoints" / "round-000002.ckpt").unlink()  # as if stopped after round 1
    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "resuming at round 2" in result.output
    assert_close(whole, comparable(json.loads((out / "results.json").read_text())))


# --- failures ----------------------------------------------------------------------


def test_a_failing_client_is_dropped_as_in_process(ray_cluster, tiny_config, tmp_path):
    local, remote = both_backends(tiny_config, tmp_path, extra=[Raises()])
    [failure] = remote["rounds"][1]["failed_clients"]
    assert failure["client"] == 1
    assert re.fullmatch(
        r"RuntimeError: disk full on client 1 \(raised at tests/helpers\.py:\d+ in fedaval_client_epoch_start\)",
        failure["reason"],
    )
    assert_close(comparable(local), comparable(remote))


def test_fail_policy_stops_with_the_workers_traceback(ray_cluster, tiny_config, tmp_path):
    from fedaval.api import run_training

    with pytest.raises(RunFailure, match="client 1 failed in round 2: RuntimeError: disk full") as info:
        run_training(tiny_config(backend="ray", on_client_failure="fail"), extra_plugins=[Raises()])
    cause = info.value.__cause__.__cause__
    assert "on Ray worker" in str(cause) and "fedaval_client_epoch_start" in str(cause)


class CountsSteps:
    """Keeps a plugin-wide counter in a client hook: state that would stay on
    the worker, so the Ray backend must refuse it."""

    name = "countssteps"

    def __init__(self):
        self.steps = 0

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.steps += 1


class RecordsClients:
    """Appends to a plugin-wide list in a client hook (a test probe, say)."""

    name = "recordsclients"

    def __init__(self):
        self.seen = []

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.seen.append(client.id)


@pytest.mark.parametrize("plugin, attribute", [(CountsSteps, "steps"), (RecordsClients, "seen")])
def test_client_hooks_changing_plugin_wide_state_stop_the_run(ray_cluster, tiny_config, plugin, attribute):
    from fedaval.api import run_training

    with pytest.raises(
        RunFailure, match=rf"plugin '{plugin.name}' changed its attribute '{attribute}' during client \d's round"
    ):
        run_training(tiny_config(backend="ray"), extra_plugins=[plugin()])


def test_the_stash_travels_with_its_client(tiny_config):
    """A client's plugin state (its stash) goes to a worker and back with the
    client, as one pickle with it; no Ray needed."""
    from fedaval.backends import transfer
    from fedaval.build import build_run
    from fedaval.plugins.gldp import LOCAL, RECEIVED

    run = build_run(tiny_config(plugins=["gldp"], out=None), out_dir=None)
    client = run.clients[1]
    client.stash[LOCAL] = {3: "prototype"}
    client.stash[RECEIVED] = {3: "received"}
    back = transfer.loads(run, transfer.dumps(run, {"client": client}))["client"]
    assert back is not client and back.stash[LOCAL] == {3: "prototype"} and back.stash[RECEIVED] == {3: "received"}
    assert back.strategy.client is back  # the strategy still knows its client


# --- what users get wrong ----------------------------------------------------------


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    line = one_line_error(["train", "--backend", "ray", "--out", str(tmp_path / "run"), *FAST])
    assert "pip install 'fedaval[ray]'" in line


def test_an_unreachable_ray_address_is_a_one_line_error(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    line = one_line_error(
        ["train", "--backend", "ray", "--ray-address", f"127.0.0.1:{port}", "--out", str(tmp_path / "run"), *FAST]
    )
    assert f"--ray-address '127.0.0.1:{port}'" in line and "nothing answers" in line
    line = one_line_error(
        ["train", "--backend", "ray", "--ray-address", "nohost", "--out", str(tmp_path / "r2"), *FAST]
    )
    assert "expected host:port" in line


def test_client_gpus_on_a_cluster_without_gpus_is_a_one_line_error(ray_cluster, tmp_path):
    line = one_line_error(["train", "--backend", "ray", "--client-gpus", "0.25", "--out", str(tmp_path / "run"), *FAST])
    assert "--client-gpus 0.25" in line and "no GPU" in line


def test_worker_count():
    from fedaval.backends.ray import worker_count

    assert worker_count(4, cpus=2, gpus=0, client_gpus=0) == 2
    assert worker_count(1, cpus=8, gpus=0, client_gpus=0) == 1
    assert worker_count(10, cpus=16, gpus=2, client_gpus=0.25) == 8
    assert worker_count(10, cpus=4, gpus=2, client_gpus=0.25) == 4
    assert worker_count(3, cpus=16, gpus=1, client_gpus=0.3) == 3
