"""Checkpoints after rounds, resuming from them, and the files they leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from avalanche.core import SupervisedPlugin
from click.testing import CliRunner
from helpers import AGEM, MIR, RAR, one_line_error, strip_timing

from fedaval import hookimpl
from fedaval.cli import cli

pytestmark = pytest.mark.slow  # whole trainings

FEDAVAL = [sys.executable, "-c", "from fedaval.cli import main; main()"]


def results_of(folder: Path) -> dict:
    return strip_timing(json.loads((folder / "results.json").read_text()))


# --- a real process, killed and resumed ---------------------------------------
@pytest.mark.parametrize(
    "method",
    [
        ["--plugins", "fedavg"],
        # prototypes, an exemplar memory, a frozen teacher and a swapped dataloader
        ["--plugins", "pfcl", "--scenario", "fcl-random", "-o", "fcl-random.clients=2"],
    ],
    ids=["fedavg", "pfcl"],
)
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_results(tmp_path, method):
    args = [
        *FEDAVAL,
        "train",
        "--quiet",
        "--rounds-per-task",
        "2",
        "--local-epochs",
        "2",
        "--checkpoint-every",
        "1",
        *method,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*args, "--out", str(tmp_path / "whole")], check=True, capture_output=True, env=env)
    total = len(json.loads((tmp_path / "whole" / "results.json").read_text())["rounds"])

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [*args, "--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    # round 3 is the first round of task 2: the kill lands in the middle of a task
    third = killed / "checkpoints" / "round-000003.ckpt"
    deadline = time.monotonic() + 120
    while not third.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert len(json.loads((killed / "results.json").read_text())["rounds"]) < total

    resumed = subprocess.run(
        [*FEDAVAL, "train", "--resume", str(killed), "--quiet"], capture_output=True, text=True, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at round" in resumed.stdout
    assert results_of(killed) == results_of(tmp_path / "whole")


# --- in-process resume from every checkpoint of several methods ----------------
@pytest.mark.parametrize(
    "settings",
    [
        dict(plugins=["avalanche:ReplayPlugin"], plugin_options={"avalanche": {"mem_size": "40"}}),
        dict(plugins=["fedlwf"]),
        dict(plugins=["fedprok"]),
        dict(plugins=["gldp"], scenario="sthfl", scenario_options={"clients": 3, "tasks": 2, "classes_per_task": 2}),
        dict(plugins=["fedavg"], clients_per_round=1, scenario_options={"clients": 3, "tasks": 2}),
        dict(plugins=["glfc"], plugin_options={"glfc": {"inversion_steps": 2, "memory_size": 12}}),
        # live iterators over their memories between rounds: until session 36 a traceback at the first checkpoint
        dict(plugins=["avalanche:AGEMPlugin"], plugin_options={"avalanche": AGEM}),
        dict(plugins=["avalanche:MIRPlugin"], plugin_options={"avalanche": MIR}),
        dict(plugins=["avalanche:RARPlugin"], plugin_options={"avalanche": RAR}),
        # a model replaced at each task start; path scores kept over a task's rounds
        dict(plugins=["avalanche:GDumbPlugin"], plugin_options={"avalanche": {"mem_size": "40"}}),
        dict(plugins=["avalanche:RWalkPlugin"], plugin_options={"avalanche": {"delta_t": "5"}}),
    ],
    ids=["replay", "lwf", "fedprok", "gldp", "sampled", "glfc", "agem", "mir", "rar", "gdumb", "rwalk"],
)
def test_resume_from_any_round_matches_the_whole_run(tiny_config, tmp_path, settings):
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    config = tiny_config(out=str(tmp_path / "whole"), rounds_per_task=3, keep_checkpoints=100, **settings)
    whole = strip_timing(run_training(config))
    rounds = [r for r, _ in checkpoint.saved(tmp_path / "whole")]
    assert sorted(rounds) == list(range(1, 7))
    for round in (2, 4):  # mid-task and at the start of task 2's second round
        run = build_run(config, out_dir=tmp_path / f"resumed{round}")
        results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", round))
        assert len(results["rounds"]) == round
        assert strip_timing(train(run, results=results)) == whole


# --- schedule, pruning, atomic files ------------------------------------------
def test_checkpoint_interval_and_pruning(tiny_config, tmp_path):
    from fedaval import checkpoint
    from fedaval.api import run_training

    run_training(tiny_config(out=str(tmp_path / "every2"), rounds_per_task=3, checkpoint_every=2, keep_checkpoints=2))
    assert [r for r, _ in checkpoint.saved(tmp_path / "every2")] == [6, 4]
    run_training(tiny_config(out=str(tmp_path / "never"), checkpoint_every=0))
    assert not (tmp_path / "never" / "checkpoints").exists()
    assert not list((tmp_path / "every2").rglob("*.tmp"))


def test_auto_checkpoints_at_stage_ends_when_rounds_are_short(tiny_config, tmp_path):
    """The default, ``auto``: millisecond rounds are not each checkpointed
    (before: every round was, 40 ms a round of pickling on digits)."""
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.config import RunConfig

    assert RunConfig().checkpoint_every == "auto"
    run_training(
        tiny_config(out=str(tmp_path / "auto"), rounds_per_task=3, checkpoint_every="auto", keep_checkpoints=9)
    )
    assert [r for r, _ in checkpoint.saved(tmp_path / "auto")] == [6, 3]


def test_auto_checkpoints_once_a_minute_within_a_stage(monkeypatch):
    from types import SimpleNamespace

    from fedaval import checkpoint

    clock = [0.0]
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: clock[0])
    run = SimpleNamespace(config=SimpleNamespace(checkpoint_every="auto"), total_rounds=10)
    schedule = checkpoint.Schedule(run)
    due = []
    for round, seconds in enumerate([20, 20, 25, 20, 30, 70, 1, 1, 1, 1], start=1):
        clock[0] += seconds
        due.append(schedule.due(run, round, task_end=round == 8))
    # 65 s after the start (round 3); rounds 4-5 (50 s on) not yet; round 6 (120 s on); the stage end; the last
    assert [r for r, d in enumerate(due, start=1) if d] == [3, 6, 8, 10]


def test_auto_checkpoints_are_spaced_by_their_cost(monkeypatch):
    """A checkpoint that kept training waiting for 2 s is not followed by
    another within 50 x 2 = 100 s, even past the minute; a cheap one is."""
    from types import SimpleNamespace

    from fedaval import checkpoint

    clock = [0.0]
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: clock[0])

    def pickles_for(seconds):
        def save_in_background(run, results, fork=False):
            clock[0] += seconds
            return None

        return save_in_background

    run = SimpleNamespace(config=SimpleNamespace(checkpoint_every="auto", checkpoint_writer="thread"), total_rounds=100)
    schedule = checkpoint.Schedule(run)
    due = []
    for round in range(1, 40):
        clock[0] += 10
        if schedule.due(run, round, task_end=False):
            due.append(round)
            monkeypatch.setattr(checkpoint, "save_in_background", pickles_for(2.0 if round < 20 else 0.1))
            schedule.save(run, {})
    # round 6 (60 s); then 100 s after it began: round 16 (2 s + 10 s a round), then round 26;
    # round 26's checkpoint was cheap: once a minute again (6 rounds)
    assert due == [6, 16, 26, 32, 38]


@pytest.mark.parametrize("value", ["sometimes", "-1", -2, "1.5"])
def test_bad_checkpoint_every_is_a_one_line_error(value):
    from fedaval.config import RunConfig
    from fedaval.errors import FedavalUsageError

    with pytest.raises(FedavalUsageError, match="auto or an integer >= 0"):
        RunConfig(checkpoint_every=value).validate()


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tiny_config, tmp_path, monkeypatch):
    from fedaval import checkpoint
    from fedaval.build import build_run

    config = tiny_config(out=str(tmp_path / "run"))
    run = build_run(config, out_dir=tmp_path / "run")
    run.round = 1
    first = checkpoint.save(run, {"rounds": [1]})
    before = first.read_bytes()

    class DiesWriting:  # the file's pickle.dump (the run's objects are pickled to bytes before)
        @staticmethod
        def dump(obj, fh, protocol=None):
            fh.write(b"half a pickle")
            raise KeyboardInterrupt  # as a kill would, between write and rename

    monkeypatch.setattr(checkpoint, "pickle", DiesWriting)
    run.round = 2
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(run, {"rounds": [1, 2]})
    assert [r for r, _ in checkpoint.saved(tmp_path / "run")] == [1]
    assert first.read_bytes() == before


def test_a_checkpoint_holds_the_tensors_as_they_were_when_it_was_taken(tiny_config, tmp_path, monkeypatch):
    """The run's objects are pickled at the end of the round and written in the
    background while the next round changes the tensors in place: the
    checkpoint must hold copies of the storages, not the storages."""
    import threading

    import torch

    from fedaval import checkpoint
    from fedaval.build import build_run

    config = tiny_config(out=str(tmp_path / "run"))
    run = build_run(config, out_dir=tmp_path / "run")
    run.round = 1
    weight = next(run.clients[0].model.parameters())
    before = weight.detach().clone()
    go = threading.Event()
    write = checkpoint._write_snapshot

    def after_the_next_round(*args):
        go.wait(30)
        write(*args)

    monkeypatch.setattr(checkpoint, "_write_snapshot", after_the_next_round)
    path = checkpoint.save_in_background(run, {"rounds": [1]})
    with torch.no_grad():
        weight.add_(1.0)  # the next round trains
    go.set()
    checkpoint.wait(run)
    fresh = build_run(config, out_dir=tmp_path / "run")
    checkpoint.restore(fresh, path)
    assert torch.equal(next(fresh.clients[0].model.parameters()), before)


# --- checkpoints written by a forked child ------------------------------------
# (on the CPU whatever FEDAVAL_TEST_DEVICE says: a forked child cannot use CUDA, fedaval.checkpoint.can_fork)
def test_a_forked_checkpoint_is_the_in_process_one_written_by_another_process(tiny_config, tmp_path, monkeypatch):
    """Byte for byte the file the process writes, the run's random generators
    included (Python's ``random`` reseeds itself in a forked child), written
    by the child; the process only forks."""
    from fedaval import checkpoint
    from fedaval.build import build_run

    run = build_run(tiny_config(out=str(tmp_path / "run"), device="cpu"), out_dir=tmp_path / "run")
    run.round = 1
    path = checkpoint.save_in_background(run, {"rounds": [1]})
    checkpoint.wait(run)
    in_process = path.read_bytes()
    path.unlink()

    writers = tmp_path / "writers"
    write = checkpoint._write_snapshot

    def noting_the_writer(*args):
        with open(writers, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        write(*args)

    monkeypatch.setattr(checkpoint, "_write_snapshot", noting_the_writer)
    monkeypatch.setattr(checkpoint.state, "dump", _not_in(os.getpid(), checkpoint.state.dump))
    assert checkpoint.save_in_background(run, {"rounds": [1]}, fork=True) == path
    checkpoint.wait(run)
    assert path.read_bytes() == in_process
    assert [int(pid) for pid in writers.read_text().split()] != [os.getpid()]


def _not_in(pid, function):
    def wrapper(*args, **kwargs):
        assert os.getpid() != pid, "the run's objects were pickled in the process"
        return function(*args, **kwargs)

    return wrapper


def test_a_forked_checkpoint_holds_the_run_as_it_was_at_the_fork(tiny_config, tmp_path, monkeypatch):
    """The next round changes tensors in place and draws random numbers while
    the child still writes: the checkpoint has them as they were."""
    import random

    import torch

    from fedaval import checkpoint
    from fedaval.build import build_run

    config = tiny_config(out=str(tmp_path / "run"), device="cpu")
    run = build_run(config, out_dir=tmp_path / "run")
    run.round = 1
    weight = next(run.clients[0].model.parameters())
    before, drawn = weight.detach().clone(), random.getstate()
    write = checkpoint._write_snapshot

    def slowly(*args):
        time.sleep(1.0)
        write(*args)

    monkeypatch.setattr(checkpoint, "_write_snapshot", slowly)
    path = checkpoint.save_in_background(run, {"rounds": [1]}, fork=True)
    with torch.no_grad():
        weight.add_(1.0)  # the next round trains
    random.random()
    assert not path.exists(), "the child is still writing"
    checkpoint.wait(run)
    fresh = build_run(config, out_dir=tmp_path / "run")
    checkpoint.restore(fresh, path)
    assert torch.equal(next(fresh.clients[0].model.parameters()), before)
    assert random.getstate() == drawn


def test_a_forked_checkpoints_error_is_raised_in_the_process(tiny_config, tmp_path, monkeypatch):
    import errno

    from fedaval import checkpoint
    from fedaval.build import build_run
    from fedaval.errors import RunFailure

    run = build_run(tiny_config(out=str(tmp_path / "run"), device="cpu"), out_dir=tmp_path / "run")
    run.round = 1

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_snapshot", full)
    checkpoint.save_in_background(run, {}, fork=True)
    with pytest.raises(OSError) as raised:
        checkpoint.wait(run)
    assert raised.value.errno == errno.ENOSPC
    checkpoint.wait(run)  # reported once

    monkeypatch.setattr(checkpoint, "_write_snapshot", lambda *args: os.kill(os.getpid(), signal.SIGKILL))
    path = checkpoint.save_in_background(run, {}, fork=True)
    with pytest.raises(RunFailure, match=f"the process writing checkpoint {path} was killed by signal 9"):
        checkpoint.wait(run)
    assert not path.exists()


def test_a_forked_checkpoint_where_sigchld_is_ignored(tiny_config, tmp_path):
    """A process that ignores SIGCHLD gets no exit status of its children:
    the forked checkpoint is still waited for, and its file says it was written."""
    from fedaval import checkpoint
    from fedaval.build import build_run

    run = build_run(tiny_config(out=str(tmp_path / "run"), device="cpu"), out_dir=tmp_path / "run")
    run.round = 1
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        path = checkpoint.save_in_background(run, {"rounds": [1]}, fork=True)
        checkpoint.raise_if_failed(run)
        checkpoint.wait(run)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert path.exists()


def test_a_checkpoint_that_cannot_fork_is_written_in_the_process(tiny_config, tmp_path, monkeypatch, caplog):
    import errno

    from fedaval import checkpoint
    from fedaval.build import build_run

    run = build_run(tiny_config(out=str(tmp_path / "run"), device="cpu"), out_dir=tmp_path / "run")
    run.round = 1

    def no_memory():
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(checkpoint.os, "fork", no_memory)
    open_before = len(os.listdir("/proc/self/fd"))
    path = checkpoint.save_in_background(run, {"rounds": [1]}, fork=True)
    checkpoint.wait(run)
    assert path.exists() and "cannot fork to write a checkpoint (" in caplog.text
    assert len(os.listdir("/proc/self/fd")) == open_before, "the pipe is closed"


def test_checkpoints_are_forked_after_a_slow_one_where_the_run_can_fork(monkeypatch):
    from types import SimpleNamespace

    import torch

    from fedaval import checkpoint

    clock, forked, costs = [0.0], [], []
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: clock[0])

    def save_in_background(run, results, fork=False):
        forked.append(fork)
        clock[0] += 0.01 if fork else costs[len(forked) - 1]

    monkeypatch.setattr(checkpoint, "save_in_background", save_in_background)
    for writer, backend, device, cuda, offload, expected in [
        ("auto", "local", "cpu", False, "none", [False, False, True, True]),
        ("auto", "local", "cpu", False, "cpu", [False, False, True, True]),
        ("thread", "local", "cpu", False, "none", [False] * 4),  # --checkpoint-writer thread: never
        ("auto", "ray", "cpu", False, "none", [False] * 4),
        ("auto", "local", "meta", False, "none", [False] * 4),  # not the CPU: CUDA cannot be used in a fork
        ("auto", "local", "cpu", True, "none", [False] * 4),  # nor once the process has initialised it
        ("auto", "local", "cpu", False, "disk", [False] * 4),  # the next round rewrites offloaded clients' files
    ]:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda cuda=cuda: cuda)
        config = SimpleNamespace(checkpoint_every=1, checkpoint_writer=writer, backend=backend, offload_clients=offload)
        run = SimpleNamespace(config=config, device=torch.device(device))
        schedule, forked[:] = checkpoint.Schedule(run), []
        costs[:] = [0.05, 0.3, 0.05, 0.3]  # in the process, the second is slow (FORK_ABOVE_SECONDS = 0.2)
        for _ in costs:
            schedule.save(run, {})
        assert forked == expected, (writer, backend, device, cuda, offload)
    assert checkpoint.FORK_ABOVE_SECONDS == 0.2


@pytest.mark.parametrize(
    "settings",
    [
        dict(plugins=["fedavg"]),
        dict(plugins=["fedprok"]),
        # idle clients offloaded to memory, their pickles and storages in the fork's snapshot
        dict(
            plugins=["fedavg"], clients_per_round=1, offload_clients="cpu", scenario_options={"clients": 3, "tasks": 2}
        ),
    ],
    ids=["fedavg", "fedprok", "offloaded"],
)
def test_a_run_checkpointed_by_forks_resumes_to_the_whole_run(tiny_config, tmp_path, monkeypatch, settings):
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    forks = []
    monkeypatch.setattr(checkpoint, "FORK_ABOVE_SECONDS", 0.0)  # every checkpoint after the first
    monkeypatch.setattr(checkpoint, "_ForkedWriter", _counting(checkpoint._ForkedWriter, forks))
    config = tiny_config(out=str(tmp_path / "whole"), rounds_per_task=3, keep_checkpoints=100, device="cpu", **settings)
    whole = strip_timing(run_training(config))
    assert len(forks) == 5
    assert [r for r, _ in checkpoint.saved(tmp_path / "whole")] == list(range(6, 0, -1))
    threads = tiny_config(out=str(tmp_path / "threads"), rounds_per_task=3, device="cpu", **settings)
    threads.checkpoint_writer = "thread"  # never forks
    same = strip_timing(run_training(threads))
    assert {**same, "config": None} == {**whole, "config": None} and len(forks) == 5
    for round in (2, 4):
        run = build_run(config, out_dir=tmp_path / f"resumed{round}")
        results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", round))
        assert strip_timing(train(run, results=results)) == whole


def _counting(cls, calls):
    def make(*args, **kwargs):
        calls.append(1)
        return cls(*args, **kwargs)

    return make


def test_results_json_is_not_held_back_by_a_checkpoint_being_written(tiny_config, tmp_path, monkeypatch):
    """results.json is rewritten while a checkpoint is still being written (in
    a thread or a forked child); the error of one that has failed stops it."""
    import errno
    import threading

    from fedaval import checkpoint
    from fedaval.build import build_run
    from fedaval.coordinator import ResultsSchedule

    run = build_run(tiny_config(out=str(tmp_path / "run"), device="cpu"), out_dir=tmp_path / "run")
    run.round = 1
    go, write = threading.Event(), checkpoint._write_snapshot

    def when_told(*args):
        go.wait(10)
        write(*args)

    monkeypatch.setattr(checkpoint, "_write_snapshot", when_told)
    path = checkpoint.save_in_background(run, {"rounds": [1]})
    ResultsSchedule().write(run, {"rounds": [1]})
    assert (tmp_path / "run" / "results.json").exists() and not path.exists()
    go.set()
    checkpoint.wait(run)
    assert path.exists()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    for fork in (False, True):
        monkeypatch.setattr(checkpoint, "_write_snapshot", full)
        checkpoint.save_in_background(run, {}, fork=fork)
        while not run.checkpoint_writer.done():
            time.sleep(0.01)
        with pytest.raises(OSError, match="No space left"):
            ResultsSchedule().write(run, {"rounds": [1, 2]})
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == {"rounds": [1]}


def test_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tiny_config, tmp_path, caplog):
    from fedaval import checkpoint
    from fedaval.api import resume_training, run_training

    whole = strip_timing(run_training(tiny_config(out=str(tmp_path / "run"), keep_checkpoints=10)))
    checkpoint.path_for(tmp_path / "run", 4).write_bytes(b"not a pickle")
    checkpoint.path_for(tmp_path / "run", 3).unlink()  # resume from round 2
    (tmp_path / "run" / "results.json").unlink()
    assert strip_timing(resume_training(tmp_path / "run")) == whole
    assert "round-000004.ckpt cannot be read" in caplog.text


# --- what users get wrong -----------------------------------------------------


class HoldsAnIterator(SupervisedPlugin):
    """An Avalanche plugin keeping a DataLoader iterator (which raises
    NotImplementedError when pickled, as RARPlugin's did)."""

    def __init__(self):
        super().__init__()
        self.batches = iter(torch.utils.data.DataLoader(list(range(4))))


class AttachesIt:
    name = "attaches-it"

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        return [HoldsAnIterator()]


def test_a_clients_avalanche_plugin_that_cannot_be_saved_is_a_one_line_error_naming_it(tiny_config, tmp_path):
    from fedaval.api import run_training
    from fedaval.errors import PluginError

    with pytest.raises(PluginError) as info:  # until session 36 an uncaught NotImplementedError
        run_training(tiny_config(out=str(tmp_path / "r")), extra_plugins=[AttachesIt()])
    assert str(info.value).startswith(
        "cannot save the run's state: ('{} cannot be pickled', '_SingleProcessDataLoaderIter'); "
        "client 0's Avalanche plugin HoldsAnIterator holds it (a client's Avalanche plugins are saved with it, "
    )
    assert "\n" not in str(info.value)


def test_running_out_of_memory_while_saving_is_not_called_an_unpicklable_object(monkeypatch):
    """Any other refusal of the pickler is an object that cannot be saved
    (one line); no room is no room."""
    from fedaval import state

    def no_room(self, obj):
        raise MemoryError

    monkeypatch.setattr(state.RunPickler, "dump", no_room)
    monkeypatch.setattr(state, "shared_objects", lambda run, extra: {})
    with pytest.raises(MemoryError):
        state.dumps(None, {"x": 1})


def test_resume_errors_are_one_line(tmp_path, tiny_config):
    from fedaval.api import run_training

    assert "no such folder" in one_line_error(["train", "--resume", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "not a fedaval run folder (no config.json)" in one_line_error(["train", "--resume", str(tmp_path / "empty")])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model": "bert"}')
    assert "not a fedaval run configuration" in one_line_error(["train", "--resume", str(tmp_path / "other")])
    run_training(tiny_config(out=str(tmp_path / "nockpt"), checkpoint_every=0))
    assert "has no checkpoint" in one_line_error(["train", "--resume", str(tmp_path / "nockpt")])
    line = one_line_error(["train", "--resume", str(tmp_path / "nockpt"), "--lr", "0.1", "--seed", "3"])
    assert "--resume takes no other run option" in line and "--lr" in line and "--seed" in line
    for flag, value in [("--checkpoint-every", "-1"), ("--keep-checkpoints", "0"), ("--on-client-failure", "skip")]:
        line = one_line_error(["train", flag, value, "--out", str(tmp_path / "x")])
        assert flag in line and value in line


def test_resume_refuses_a_config_json_edited_since_the_run_began(tiny_config, tmp_path):
    """Editing config.json and resuming trained with the new values while
    results.json reported the old ones (a changed client count or a bad value
    ended in a traceback)."""
    from fedaval.api import run_training

    run_training(tiny_config(out=str(tmp_path / "run")))
    path = tmp_path / "run" / "config.json"
    original = path.read_text()
    for key, value in [("lr", 0.5), ("lr", "fast"), ("plugins", ["fedprox"]), ("rounds_per_task", 4)]:
        path.write_text(json.dumps({**json.loads(original), key: value}))
        line = one_line_error(["train", "--resume", str(tmp_path / "run")])
        assert "config.json differs from the configuration the run was started with" in line and key in line
    path.write_text(json.dumps({**json.loads(original), "out": "/moved/elsewhere"}))  # a moved folder is fine
    result = CliRunner().invoke(cli, ["train", "--resume", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output


def test_resume_refuses_a_checkpoint_copied_in_from_a_run_of_another_configuration(tiny_config, tmp_path):
    import shutil

    from fedaval import checkpoint
    from fedaval.api import run_training

    run_training(tiny_config(out=str(tmp_path / "avg")))
    run_training(tiny_config(plugins=["fedprox"], out=str(tmp_path / "prox")))
    (_, newest), *_ = checkpoint.saved(tmp_path / "avg")
    (_, other), *_ = checkpoint.saved(tmp_path / "prox")
    shutil.copyfile(other, newest)
    line = one_line_error(["train", "--resume", str(tmp_path / "avg")])
    assert "was written by a run of another configuration (plugins ['fedprox'] -> ['fedavg']" in line


def test_an_existing_run_folder_points_to_resume(tiny_config, tmp_path):
    from fedaval.api import run_training

    run_training(tiny_config(out=str(tmp_path / "run")))
    line = one_line_error(["train", "--out", str(tmp_path / "run")])
    assert "already holds a run" in line and "--resume" in line


def test_resuming_a_finished_run_changes_nothing(tiny_config, tmp_path):
    from fedaval.api import run_training

    run_training(tiny_config(out=str(tmp_path / "run")))
    before = (tmp_path / "run" / "results.json").read_text()
    result = CliRunner().invoke(cli, ["train", "--resume", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "already complete" in result.output
    assert strip_timing(json.loads(before)) == results_of(tmp_path / "run")
