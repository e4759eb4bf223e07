"""Results that cannot be silently wrong, and one-line errors instead of
tracebacks (issue 19): run status, competing plugins, bad paths, full disks,
interruptions."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers import one_line_error, strip_timing, tiny_run_config

from fedaval import hookimpl
from fedaval.cli import cli

TINY = [
    *("-o", "fcil-sync.clients=2", "-o", "fcil-sync.tasks=2", "--rounds-per-task", "2", "--device", "cpu", "--quiet"),
    *("--checkpoint-every", "1"),  # these tests stop after chosen rounds
]


def results_of(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


# ---------------------------------------------------------------- run status


class Terminate:
    """Sends this process SIGTERM in round 2 (once per test session)."""

    name = "terminate"
    fired = False

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if run.round == 2 and not Terminate.fired:
            Terminate.fired = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_says_the_round_and_the_resume_command_then_resume_completes(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--out", str(out), "--plugins", "test_robustness:Terminate", *TINY])
    assert result.exit_code == 130, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "interrupted in round 2 of 4" in lines[0]
    assert f"the run folder {out} is intact" in lines[0]
    assert lines[0].endswith(f"continue with: fedaval train --resume {out}")
    assert results_of(out)["status"] == {"state": "interrupted", "rounds_done": 1, "rounds_total": 4}

    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert results_of(out)["status"] == {"state": "complete", "rounds_done": 4, "rounds_total": 4}


def test_a_time_limit_stops_between_rounds_checkpoints_and_resumes_to_the_whole_run(tmp_path):
    """``--time-limit``: the run stops before a round that might not end in
    time, with the last finished round checkpointed (here round 1, which the
    ``auto`` schedule does not checkpoint on digits), so nothing is redone."""
    from fedaval import checkpoint

    args = [a for a in TINY if a not in ("--checkpoint-every", "1")]  # the default schedule, auto
    whole, out = tmp_path / "whole", tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--out", str(whole), "--time-limit", "3600", *args])
    assert result.exit_code == 0, result.output

    # 1 microsecond: round 1 always runs, then the longest round so far no longer fits
    line = one_line_error(["train", "--out", str(out), "--time-limit", "1e-6", *args], code=75)
    assert line.startswith("fedaval: stopped after round 1 of 4 by --time-limit 1e-06"), line
    assert line.endswith(f"holds round 1's checkpoint; continue with: fedaval train --resume {out}"), line
    assert results_of(out)["status"] == {"state": "stopped", "rounds_done": 1, "rounds_total": 4}
    assert [r for r, _ in checkpoint.saved(out)] == [1]

    # a resume with no time for its longest round stops before training anything
    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--time-limit", "1e-6", "--quiet"])
    assert result.exit_code == 75, result.output
    assert "stopped after round 1 of 4" in result.output
    assert results_of(out)["status"]["rounds_done"] == 1

    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert results_of(out)["status"] == {"state": "complete", "rounds_done": 4, "rounds_total": 4}
    assert strip_timing(results_of(out)["rounds"]) == strip_timing(results_of(whole)["rounds"])
    assert strip_timing(results_of(out)["final"]) == strip_timing(results_of(whole)["final"])


def test_a_time_limit_covers_every_seed_and_names_those_not_started(tmp_path):
    out = tmp_path / "run"
    line = one_line_error(["train", "--out", str(out), "--seeds", "1,2", "--time-limit", "1e-6", *TINY], code=75)
    assert line.endswith("not started: seed 2"), line
    assert results_of(tmp_path / "run-s1")["status"]["state"] == "stopped"
    assert not (tmp_path / "run-s2").exists()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bad_time_limit_is_one_line(tmp_path, value):
    line = one_line_error(["train", "--out", str(tmp_path / "run"), "--time-limit", value, *TINY])
    assert "--time-limit" in line and "above 0" in line, line
    assert not (tmp_path / "run").exists()


def test_the_time_limit_keeps_room_for_the_longest_round_and_the_checkpoint():
    import time

    from fedaval.coordinator import TimeLimit

    limit = TimeLimit(seconds=10.0, start=time.monotonic())
    rounds = {"rounds": [{"seconds": 1.0}, {"seconds": 5.0}, {"seconds": 2.0}]}
    assert not limit.reached({"rounds": []}, checkpoint_wait=100.0)  # nothing measured: the first round runs
    assert not limit.reached(rounds, checkpoint_wait=0.0)
    assert limit.reached(rounds, checkpoint_wait=6.0)  # 5 s round + 6 s checkpoint > ~10 s left
    assert TimeLimit(seconds=4.0, start=time.monotonic()).reached(rounds, checkpoint_wait=0.0)


def _full_disk_on(monkeypatch, module, name, after: int, code: int = errno.ENOSPC):
    """Make ``module.name`` raise ENOSPC (or ``code``) from its call number ``after + 1`` on."""
    real = getattr(module, name)
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, write)


@pytest.mark.parametrize("fork", [False, True], ids=["in-process", "forked"])
def test_full_disk_stops_with_one_line_keeps_the_last_good_files_and_resumes(tmp_path, monkeypatch, fork):
    import fedaval.state
    from fedaval import checkpoint

    out = tmp_path / "run"
    forks: list[int] = []
    if fork:  # round 2's checkpoint is written by a forked child (fedaval.checkpoint.Schedule)
        monkeypatch.setattr(checkpoint, "FORK_ABOVE_SECONDS", 0.0)
        forked_writer = checkpoint._ForkedWriter
        monkeypatch.setattr(checkpoint, "_ForkedWriter", lambda *args: forks.append(1) or forked_writer(*args))
    # the checkpoint of round 2 fails, half written: round 1's results.json and checkpoint stay
    _full_disk_on(monkeypatch, fedaval.state, "dump", after=1)
    line = one_line_error(["train", "--out", str(out), *TINY], code=2)
    # in the process, round 2's checkpoint fails at once; a forked child's failure is seen by
    # round 2's rewrite of results.json if the child has ended by then, else by round 3's checkpoint
    done = results_of(out)["status"]["rounds_done"]
    assert done == 1 or (fork and done == 2)
    assert "no space left on the device" in line and f"after round {done + 1}" in line
    assert "checkpoint of round 1 are kept" in line and line.endswith(f"fedaval train --resume {out}")
    assert len(forks) == fork
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round-000001.ckpt"], "no temporary file left"
    monkeypatch.undo()

    # a temporary file left by a kill does not break --resume
    (out / "checkpoints" / "round-000002.ckpt.tmp").write_bytes(b"half a checkpoint")
    (out / "results.json.tmp").write_text('{"half": ')
    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    resumed = results_of(out)
    assert resumed["status"] == {"state": "complete", "rounds_done": 4, "rounds_total": 4}

    # the same run uninterrupted gives the same results
    from fedaval.api import run_training
    from fedaval.config import RunConfig

    settings = json.loads((out / "config.json").read_text())
    whole = run_training(RunConfig.from_dict({**settings, "out": str(tmp_path / "whole")}))
    assert strip_timing(resumed)["rounds"] == strip_timing(whole)["rounds"]

    # --resume on the finished run rewrites a corrupt results.json from the checkpoint
    (out / "results.json").write_text('{"rounds": [tru')
    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    assert strip_timing(results_of(out)) == strip_timing(resumed)


def test_full_disk_writing_results_json_is_one_line(tmp_path, monkeypatch):
    import fedaval.coordinator

    out = tmp_path / "run"
    _full_disk_on(monkeypatch, fedaval.coordinator, "atomic_write_json", after=1)
    line = one_line_error(["train", "--out", str(out), *TINY], code=2)
    assert "no space left" in line and f"--resume {out}" in line
    assert results_of(out)["status"]["rounds_done"] == 1, "the last good results.json stays"


def test_full_disk_before_the_first_round_is_one_line(tmp_path, monkeypatch):
    import fedaval.atomic

    _full_disk_on(monkeypatch, fedaval.atomic, "atomic_write_json", after=0)
    line = one_line_error(["train", "--out", str(tmp_path / "run"), *TINY], code=2)
    assert "config.json (No space left on device); nothing was trained" in line


def test_a_full_disk_before_the_first_checkpoint_does_not_point_to_resume(tmp_path, monkeypatch):
    """Nothing to resume from: the line says to start again, not ``--resume``."""
    import fedaval.state

    _full_disk_on(monkeypatch, fedaval.state, "dump", after=0)
    line = one_line_error(["train", "--out", str(tmp_path / "run"), *TINY], code=2)
    assert "no checkpoint was saved yet, so the run cannot be resumed" in line and "--resume" not in line


def test_a_full_disk_while_clients_are_offloaded_to_disk_is_one_line(tmp_path, monkeypatch):
    """``--offload-clients disk`` writes into the run folder after each round (a traceback before)."""
    import fedaval.client

    out = tmp_path / "run"
    args = ["--clients-per-round", "1", "--offload-clients", "disk"]
    _full_disk_on(monkeypatch, fedaval.client, "atomic_file", after=0)  # the first offload, as the run is built
    line = one_line_error(["train", "--out", str(tmp_path / "built"), *TINY, *args], code=2)
    assert "--offload-clients disk: no room to offload client 0" in line and "nothing was trained" in line
    monkeypatch.undo()
    _full_disk_on(monkeypatch, fedaval.client, "atomic_file", after=2)  # 2 clients offloaded when built, then a round
    line = one_line_error(["train", "--out", str(out), *TINY, *args], code=2)
    assert "no space left on the device" in line


def test_a_file_size_limit_stops_the_run_like_a_full_disk(tmp_path, monkeypatch):
    """``ulimit -f`` (EFBIG) while a checkpoint is written: one line, not a traceback."""
    import fedaval.state

    _full_disk_on(monkeypatch, fedaval.state, "dump", after=1, code=errno.EFBIG)
    line = one_line_error(["train", "--out", str(tmp_path / "run"), *TINY], code=2)
    assert "File too large" in line and "checkpoint of round 1 are kept" in line


class InterruptSetUp:
    """Ctrl-C while the run is being set up."""

    name = "interrupt-setup"

    @hookimpl
    def fedaval_setup(self, run):
        raise KeyboardInterrupt


class TerminateBoth:
    """In round 3, sends SIGTERM to the child writing round 2's checkpoint and to this process."""

    name = "terminate-both"

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        writer = run.checkpoint_writer
        if run.round == 3 and writer is not None and getattr(writer, "pid", None):
            os.kill(writer.pid, signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_waits_for_the_checkpoint_a_forked_child_is_writing(tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) that reaches the child too does not stop it: the
    run stops with the checkpoint it was writing, and resumes from it."""
    import time

    from fedaval import checkpoint

    monkeypatch.setattr(checkpoint, "FORK_ABOVE_SECONDS", 0.0)  # rounds 2 to 4: forked
    write = checkpoint._write_snapshot

    def slowly(*args):  # still writing when round 3 begins
        time.sleep(1.0)
        write(*args)

    monkeypatch.setattr(checkpoint, "_write_snapshot", slowly)
    out = tmp_path / "run"
    line = one_line_error(["train", "--out", str(out), "--plugins", "test_robustness:TerminateBoth", *TINY], code=130)
    assert "interrupted in round 3 of 4" in line and "(newest checkpoint: round 2)" in line
    monkeypatch.undo()
    result = CliRunner().invoke(cli, ["train", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0 and "resuming at round 3" in result.output, result.output


def test_ctrl_c_before_the_first_round_is_one_line(tmp_path):
    line = one_line_error(
        ["train", "--out", str(tmp_path / "r"), "--plugins", "test_robustness:InterruptSetUp", *TINY], code=130
    )
    assert "interrupted before the run's first round finished" in line


class RefuseSetUp:
    """A plugin that refuses the run in its set-up, after the run folder is made."""

    name = "refuse-setup"

    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.errors import FedavalUsageError

        raise FedavalUsageError("refuse-setup refuses this run")


@pytest.mark.parametrize("plugin", ["RefuseSetUp", "InterruptSetUp"])
def test_a_run_refused_while_it_is_built_leaves_no_folder_behind(tmp_path, plugin):
    args = ["--plugins", f"test_robustness:{plugin}", *TINY]
    code = 2 if plugin == "RefuseSetUp" else 130
    one_line_error(["train", "--out", str(tmp_path / "new" / "run"), *args], code=code)
    assert not (tmp_path / "new").exists(), "the folders this run made are removed"
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("x")
    one_line_error(["train", "--out", str(kept), *args], code=code)
    assert (kept / "notes.txt").read_text() == "x", "a folder the run did not make, and its files, stay"
    one_line_error(["train", "--out", str(kept / "run"), *args], code=code)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- competing plugins


class MedianFusion:
    """A third-party fusion rule."""

    name = "median"

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        return None


class DefaultMedianFusion:
    """The same, declared an overridable default."""

    name = "default-median"

    @hookimpl(trylast=True)
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        return None


@pytest.mark.parametrize(
    "plugins, first, second",
    [
        ("gldp,fedrep", "gldp", "fedrep"),
        ("fednova,gldp", "fednova", "gldp"),
        ("hgp,pfcl", "hgp", "pfcl"),
        ("fednova,test_robustness:MedianFusion", "fednova", "median"),
    ],
)
def test_two_plugins_competing_for_a_firstresult_hook_are_refused(tmp_path, plugins, first, second):
    line = one_line_error(["train", "--out", str(tmp_path / "r"), "--plugins", plugins, *TINY])
    assert f"plugins {first!r} and {second!r} both implement fedaval_" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "plugins, extra",
    [
        (["fedlwf", "fedreplay"], []),
        (["fednova"], [DefaultMedianFusion()]),
        (["gldp", "fedprox"], []),
        (["fedprok", "fedewc"], []),
    ],
)
def test_plugins_that_combine_or_declare_a_default_load(plugins, extra):
    from fedaval.plugin_manager import get_plugin_manager, load_plugins

    loaded = load_plugins(get_plugin_manager(), plugins, {}, extra=extra)
    assert set(plugins) <= set(loaded.names)


# ---------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--seed", "-5"], "bad value --seed -5; must be in [0, 2**32 - 1]"),
        (["--seed", str(2**32)], f"bad value --seed {2**32}"),
        (["--lr", "inf"], "bad value --lr inf; must be finite"),
        (["--lr", "nan"], "bad value --lr nan"),
        (["--weight-decay", "inf"], "bad value --weight-decay inf"),
        (["--client-gpus", "nan"], "bad value --client-gpus nan"),
        (["--clients-per-round", "1000"], "bad value --clients-per-round 1000; the scenario has 2 clients"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, args, expected):
    line = one_line_error(["train", "--out", str(tmp_path / "r"), *TINY, *args])
    assert expected in line


def test_all_seeds_are_checked_before_the_first_runs(tmp_path):
    out = tmp_path / "r"
    line = one_line_error(["train", "--out", str(out), "--seeds", "1,-2", *TINY])
    assert "bad value --seeds '1,-2': seed -2 must be in [0, 2**32 - 1]" in line
    (tmp_path / "r-s2").mkdir()
    (tmp_path / "r-s2" / "results.json").write_text("{}")
    line = one_line_error(["train", "--out", str(out), "--seeds", "1,2", *TINY])
    assert "r-s2' already holds a run" in line
    assert not (tmp_path / "r-s1").exists(), "seed 1 must not run before seed 2's folder is checked"


def test_bad_out_folders_are_one_line_errors(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file, not a folder" in one_line_error(["train", "--out", str(a_file), *TINY])
    assert f"is under {str(a_file)!r}, which is a file" in one_line_error(
        ["train", "--out", str(a_file / "run"), *TINY]
    )
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    # as root, chmod cannot make a folder read-only: say the file system is
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == read_only else real_access(p, mode))
    line = one_line_error(["train", "--out", str(read_only / "run"), *TINY])
    assert f"{str(read_only)!r} is not writable" in line


def test_report_out_dir_that_is_a_file_is_one_line(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = one_line_error(["report", str(tmp_path), "--out-dir", str(a_file)])
    assert f"--out-dir {str(a_file)!r} is a file" in line


def test_usage_errors_come_before_torch_is_imported():
    code = (
        "import sys; from fedaval.cli import cli\n"
        "for args in (['train', '--seed', '-5'], ['train', '--lr', 'nan'], ['train', '--out', '/dev/null'],\n"
        "             ['train', '--seeds', '1,-2'], ['train', '--plugins', 'nosuch'], ['train', '--scenario', 'x']):\n"
        "    try: cli(args)\n"
        "    except SystemExit as exc: assert exc.code == 2, (args, exc.code)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_default_run_folder_name_has_no_colon():
    from fedaval.api import default_out_dir

    name = default_out_dir(tiny_run_config(None, plugins=["avalanche:EWCPlugin", "mypkg.mod:Prox"])).name
    assert ":" not in name and "avalanche_EWCPlugin+mypkg.mod_Prox" in name


# ---------------------------------------------------------------- report


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    from fedaval.api import run_training

    root = tmp_path_factory.mktemp("status-runs")
    for seed in (1, 2):
        run_training(tiny_run_config(root / f"s{seed}", seed=seed, scenario_options={"clients": 2, "tasks": 2}))
    return root


def _cut_short(src: Path, dst: Path, with_status: bool) -> Path:
    """A copy of run ``src`` as if it had stopped after its first round."""
    results = results_of(src)
    results["rounds"] = results["rounds"][:1]
    if with_status:
        results["status"] = {"state": "interrupted", "rounds_done": 1, "rounds_total": 4}
    else:
        results.pop("status")  # as written before the status existed
    dst.mkdir()
    (dst / "results.json").write_text(json.dumps(results))
    return dst


@pytest.mark.parametrize("with_status", [True, False])
def test_report_refuses_an_incomplete_run_or_marks_it(two_seeds, tmp_path, with_status):
    short = _cut_short(two_seeds / "s2", tmp_path / "short", with_status)
    state = "interrupted" if with_status else "incomplete"
    line = one_line_error(["report", str(two_seeds / "s1"), str(short), "--out-dir", str(tmp_path / "rep")])
    assert f"run {str(short)!r} is not complete ({state}, 1 of 4 rounds)" in line and "--include-incomplete" in line
    assert not (tmp_path / "rep").exists()

    result = CliRunner().invoke(
        cli,
        [
            "report",
            str(two_seeds / "s1"),
            str(short),
            "--out-dir",
            str(tmp_path / "rep"),
            "--include-incomplete",
            "--no-figures",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "1,2 (1/4 rounds)" in result.output
    assert f"{two_seeds / 's1'}, {short}" in result.output, "the report says which runs make the row"
    assert "1/4 rounds" in (tmp_path / "rep" / "report.md").read_text()


def test_report_refuses_two_runs_with_the_same_seed(two_seeds, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "results.json").write_text((two_seeds / "s1" / "results.json").read_text())
    line = one_line_error(["report", str(two_seeds / "s1"), str(copy), "--out-dir", str(tmp_path / "rep")])
    assert "have the same settings and the same seed 1" in line


def test_report_lists_the_runs_of_each_row(two_seeds, tmp_path):
    result = CliRunner().invoke(
        cli, ["report", str(two_seeds / "s1"), str(two_seeds / "s2"), "--out-dir", str(tmp_path), "--no-figures"]
    )
    assert result.exit_code == 0, result.output
    assert f"fedavg fcil-sync digits: {two_seeds / 's1'}, {two_seeds / 's2'}" in result.output
    assert results_of(two_seeds / "s1")["status"] == {"state": "complete", "rounds_done": 4, "rounds_total": 4}


# ---------------------------------------------------------------- plugin metrics and loss terms


class Cheats:
    """Round metrics named like the core's, and an extra metric of its own."""

    name = "cheats"

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"global_accuracy": 0.999, "bytes_up": -5, "mine": 1.0}


def test_plugin_round_metrics_go_under_the_plugins_name(tiny_config):
    from fedaval.api import run_training

    results = run_training(tiny_config(), extra_plugins=[Cheats()])
    for record in results["rounds"]:
        assert record["plugin_metrics"] == {"cheats": {"global_accuracy": 0.999, "bytes_up": -5, "mine": 1.0}}
        assert record["global_accuracy"] != 0.999 and record["bytes_up"] > 0
    assert results["final"]["accuracy"] != 0.999 and results["final"]["bytes_up"] > 0


def _term_plugin(term, declare):
    class Term:
        name = f"term-{term}"
        loss_terms = (term,) if declare else ()

        @hookimpl
        def fedaval_client_loss(self, run, client, batch):
            return {term: batch.loss * 0}

    return Term()


@pytest.mark.parametrize("term", ["classification", "total"])
def test_a_loss_term_named_like_the_cores_is_a_one_line_error(tiny_config, term):
    from fedaval.api import run_training
    from fedaval.errors import FedavalUsageError
    from fedaval.plugin_manager import get_plugin_manager, load_plugins

    with pytest.raises(
        FedavalUsageError, match=f"plugin 'term-{term}' declares the local-loss term '{term}', which the core uses"
    ):
        load_plugins(get_plugin_manager(), [], {}, extra=[_term_plugin(term, declare=True)])
    with pytest.raises(FedavalUsageError, match=f"a plugin returns the local-loss term '{term}', a name the core uses"):
        run_training(tiny_config(), extra_plugins=[_term_plugin(term, declare=False)])


def test_two_plugins_declaring_one_loss_term_are_refused():
    from fedaval.errors import FedavalUsageError
    from fedaval.plugin_manager import get_plugin_manager, load_plugins

    a, b = _term_plugin("prox", declare=True), _term_plugin("prox", declare=True)
    b.name = "other"
    with pytest.raises(
        FedavalUsageError,
        match="plugin 'other' declares the local-loss term 'prox', which plugin 'term-prox' also declares",
    ):
        load_plugins(get_plugin_manager(), [], {}, extra=[a, b])


def test_generic_avalanche_options_without_a_type_must_be_numbers(tmp_path):
    line = one_line_error(
        [
            "train",
            "--out",
            str(tmp_path / "r"),
            "--plugins",
            "avalanche:EWCPlugin",
            "-o",
            "avalanche.ewc_lambda=abc",
            *TINY,
        ]
    )
    assert "bad value avalanche.ewc_lambda='abc'; expected a finite number" in line


# ---------------------------------------------------------------- feedback


def test_progress_shows_the_clients_of_a_round(tiny_config, capsys):
    from fedaval.api import run_training

    run_training(tiny_config(), show_progress=True)
    assert "round 1: 2/2 clients" in capsys.readouterr().err


def test_listed_avalanche_plugins_that_need_a_qp_solver_run(tiny_config):
    import tomllib

    from fedaval.api import run_training

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("quadprog") for dep in project["dependencies"]), "avalanche:GEMPlugin needs quadprog"
    results = run_training(
        tiny_config(
            plugins=["avalanche:GEMPlugin"],
            rounds_per_task=1,
            plugin_options={"avalanche": {"patterns_per_experience": "10", "memory_strength": "0.5"}},
        )
    )
    assert results["status"]["state"] == "complete"


def test_every_option_of_every_command_has_help_text():
    from fedaval.cli import cli

    missing = [
        f"{name} {param.opts[0]}"
        for name, command in cli.commands.items()
        for param in command.params
        if isinstance(param, click.Option) and not param.help
    ]
    assert missing == []


class InterruptTwice:
    """Ctrl-C in round 2, and a second one while the run writes where it stopped
    (sent from its teardown, the last of those writes)."""

    name = "interrupt-twice"

    def __init__(self):
        self.handler_at_teardown = None

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if run.round == 2:
            os.kill(os.getpid(), signal.SIGINT)

    @hookimpl
    def fedaval_teardown(self, run):
        self.handler_at_teardown = signal.getsignal(signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # ignored: it would have broken off the writes with a traceback


def test_a_second_ctrl_c_while_an_interrupted_run_stops_is_ignored(tiny_config, tmp_path):
    from fedaval.api import run_training
    from fedaval.errors import RunInterrupted

    # Ctrl-C as Python's default (an earlier test of the session may have left another handler)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        probe = InterruptTwice()
        with pytest.raises(RunInterrupted, match="interrupted"):
            run_training(tiny_config(out=tmp_path / "run"), extra_plugins=[probe])
        assert probe.handler_at_teardown is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back once the run stopped
    finally:
        signal.signal(signal.SIGINT, outside)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"]["state"] == "interrupted" and results["status"]["rounds_done"] == 1


@pytest.mark.parametrize(
    "settings, warning",
    [
        (
            dict(lr_schedule="cosine", rounds_per_task=1, scenario_options={"clients": 2, "tasks": 1}),
            "--lr-schedule cosine changes the learning rate between rounds; this run has 1 round, so it trains at --lr",
        ),
        (dict(channels_last=True), "--channels-last: the model (auto) has no convolution; nothing changes"),
    ],
)
def test_an_option_this_run_cannot_act_on_is_warned_about(tiny_config, caplog, settings, warning):
    """The session-35 audit's runs with these options equalled the runs without
    them, silently; with two rounds and a convolution they act, unwarned."""
    from fedaval.build import build_run

    def warnings(**overrides):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fedaval"):
            build_run(tiny_config(**{**settings, **overrides}))
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(warning[:15])]

    assert warnings() == [warning]
    assert warnings(model="cnn", rounds_per_task=2) == []
