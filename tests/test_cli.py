"""The command line: listings, a real run, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from helpers import one_line_error

from fedaval.cli import cli

FAST = ["-o", "fcil-sync.clients=2", "-o", "fcil-sync.tasks=2", "--rounds-per-task", "1", "--device", "cpu", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_plugins_lists_fedavg_with_its_hooks():
    result = invoke("plugins")
    assert result.exit_code == 0
    assert "fedavg" in result.output and "fedaval_server_fuse_weights" in result.output
    assert "-o fedprox.mu=0.01  (a finite number, >= 0)" in result.output  # what the option's check allows


def test_scenarios_lists_the_four_settings_with_options():
    result = invoke("scenarios")
    assert result.exit_code == 0
    for name in ("sthfl", "fcil-sync", "fcil-async", "fcl-random"):
        assert name in result.output
    assert "-o sthfl.imbalance=10.0" in result.output


def test_help_and_scenarios_do_not_import_torch():
    # `fedaval plugins` imports each plugin's module to list its hooks, and the
    # built-in method modules import torch at the top, so it is not checked here.
    code = (
        "import sys; from fedaval.cli import cli\n"
        "for args in (['--help'], ['train', '--help'], ['scenarios']):\n"
        "    try: cli(args)\n"
        "    except SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_train_writes_the_run_folder(tmp_path):
    out = tmp_path / "run"
    result = invoke("train", "--plugins", "fedavg", "--out", str(out), *FAST)
    assert result.exit_code == 0, result.output
    assert f"run folder: {out}" in result.output
    assert "final global accuracy:" in result.output
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert (
        config["scenario"] == "fcil-sync" and config["scenario_options"] == {} and config["plugin_options"]["fcil-sync"]
    )
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for record in results["rounds"]:
        for key in ("task", "global_accuracy", "mean_client_accuracy", "bytes_up", "bytes_down", "seconds"):
            assert record[key] is not None, key
        assert record["bytes_up"] > 0 and record["bytes_down"] > 0
    assert [len(t["accuracy"]) for t in results["tasks"]] == [1, 2]  # accuracy matrix rows
    final = results["final"]
    assert final["bytes_up"] == sum(r["bytes_up"] for r in results["rounds"])
    assert final["accuracy"] == results["rounds"][-1]["global_accuracy"]
    assert final["average_accuracy"] == pytest.approx(sum(t["global_accuracy"] for t in results["tasks"]) / 2)
    assert list((out / "tb").glob("events.out.tfevents.*"))


def test_existing_run_folder_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text('{"keep": true}')
    result = invoke("train", "--out", str(out), *FAST)
    assert result.exit_code == 2
    assert json.loads((out / "results.json").read_text()) == {"keep": True}


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--plugins", "nosuch"], "unknown plugin 'nosuch'; allowed:"),
        (["--scenario", "nosuch"], "unknown scenario 'nosuch'; allowed: fcil-async, fcil-sync, fcl-random, sthfl"),
        (["-o", "fedavg.nosuch=1"], "plugin 'fedavg' takes no options; got nosuch"),
        (["-o", "fcil-sync.clients=many"], "bad value fcil-sync.clients='many'; expected int"),
        (["-o", "fcil-sync.clients=0"], "bad value fcil-sync.clients=0; must be >= 1"),
        (["-o", "gamma"], "bad option 'gamma'"),
        (["-o", "nosuch.key=1"], "options given for nosuch"),
        (["--scenario", "fcil-async", "-o", "fcil-async.consensus=1.5"], "fcil-async.consensus=1.5; must be in [0, 1]"),
        (
            ["--scenario", "sthfl", "-o", "sthfl.classes_per_task=11"],
            "bad classes per task 11; the dataset has 10 classes",
        ),
        (["--dataset", "cifar10", "--data-root", "/nonexistent/x"], "--data-root '/nonexistent/x' does not exist"),
        (["--dataset", "cifar10"], "needs --data-root"),
        (["--dataset", "nosuch"], "unknown dataset 'nosuch'"),
        (["--device", "tpu"], "bad value --device 'tpu'"),
        (["--rounds-per-task", "0"], "bad value --rounds-per-task 0"),
        (["--host-memory", "free"], "bad value --host-memory free; must be one of keep, release"),
        (["--checkpoint-writer", "fork"], "bad value --checkpoint-writer fork; must be one of auto, thread"),
        (["--model", "vgg"], "unknown model 'vgg'"),
        (["--plugins", "os:nosuchthing"], "module 'os' has no attribute 'nosuchthing'"),
        (["-p", "fedprox", "-o", "fedprox.mu=inf"], "bad value fedprox.mu='inf'; expected a finite number"),
        (["-p", "fedprox", "-o", "fedprox.mu=nan"], "bad value fedprox.mu='nan'; expected a finite number"),
        (["--plugins", ""], "--plugins '' names no plugin"),
        (["--out", ""], "--out '' names no folder"),
        (["--out", "/proc/fedaval-x"], "--out '/proc/fedaval-x'"),  # made by no one: a one-line error, not OSError
        (["--out", "/tmp/" + "a" * 300], "cannot be used (File name too long)"),
        (["--data-root", "/tmp"], "--data-root '/tmp' is not read by the dataset digits"),  # was ignored
        (["--client-gpus", "0.5"], "bad value --client-gpus 0.5; must be 0 without --backend ray"),  # was ignored
        (["--ray-address", "auto"], "bad value --ray-address auto; must be unset without --backend ray"),
        (["--client-sampling", "stage"], "bad value --client-sampling stage; must be one of round, task"),
        (
            ["--lr", "1e300"],
            "bad value --lr 1e+300; must be finite, > 0 and at most float32's largest",
        ),  # overflowed in SGD
        # options other settings leave unread (the session-35 audit: each ran as if not given)
        (["-p", "pfcl", "--utility-lambda", "0.9"], "--utility-lambda 0.9 is not read: the federation model of pfcl"),
        (["--download"], "--download is not read by the dataset digits"),
        (["--lr-min", "0.04"], "--lr-min 0.04 is not read with --lr-schedule constant"),
        (["--optimizer-state", "keep"], "--optimizer-state keep is not read with --momentum 0"),
        (
            ["--checkpoint-every", "0", "--keep-checkpoints", "5"],
            "--keep-checkpoints 5 is not read with --checkpoint-every 0",
        ),
        (["--model", "nosuchmodel", "-p", "hgp"], "unknown model 'nosuchmodel'"),
        (["--model", "cnn", "-p", "hgp"], "--model cnn is not read by hgp"),
        (
            ["-p", "pfcl", "--model", "cnn", "-o", "pfcl.models=mlp"],
            "--model cnn is not read when pfcl.models names the backbones",
        ),
    ],
)
def test_bad_input_is_a_one_line_error_with_status_2(tmp_path, args, expected):
    result = CliRunner().invoke(cli, ["train", "--out", str(tmp_path / "r"), "--quiet", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedaval: error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "plugin, setting, option, before",
    [  # before: the -o's that make the setting, where it is not the plugin's default
        ("hgp", "rebalance=false", "rebalance_epochs=1", ["rebalance=false"]),
        ("hgp", "covariance=diag", "jitter=0.5", ["covariance=diag"]),
        ("hgp", "backbone=efficientnet-lite0", "vit_depth=1", ["backbone=efficientnet-lite0"]),
        ("fedprok", "fusion=false", "beta=0.9", ["fusion=false"]),
        ("fedprok", "translation=false", "weight=5", ["translation=false"]),
        ("fedprok", "freeze=false", "head_steps=3", ["freeze=false"]),
        ("fedic", "unlabelled=''", "unlabelled_samples=50", []),
        ("fedic", "calibration=full", "gate_lr=0.9", ["teacher=logit-adjust", "calibration=full"]),
        ("glfc", "memory=per-class", "memory_size=7", ["memory=per-class"]),
        ("pfcl", "memory=per-class", "memory_size=5", []),
        ("apfl", "adaptive=false", "alpha_lr=0.9", ["adaptive=false"]),
        ("fedspace", "repr_weight=0", "repr_temperature=5", ["repr_weight=0"]),
        ("attack", "rounds=1", "every=2", ["rounds=1"]),
        ("target", "synthesis=code", "adv_weight=0.5", []),
        ("target", "synthesis=paper", "lr_noise=0.1", ["synthesis=paper"]),
    ],
)
def test_a_plugin_option_its_other_settings_leave_unread_is_a_one_line_error(tmp_path, plugin, setting, option, before):
    """The session-35 audit: each ran as if the option were not given."""
    options = [arg for value in [*before, option] for arg in ("-o", f"{plugin}.{value}")]
    line = one_line_error(["train", "--out", str(tmp_path / "r"), "--quiet", "-p", plugin, *options])
    assert f"{plugin}.{option.split('=')[0]} is not read with {plugin}.{setting}; drop it or change " in line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train", "--client-streams", "abc"], "Invalid value for '--client-streams': 'abc' is not a valid integer"),
        (["train", "--lr", "fast"], "Invalid value for '--lr': 'fast' is not a valid float"),
        (["train", "--bogus", "1"], "No such option '--bogus'"),
        (["train", "--rounds-per-task"], "Option '--rounds-per-task' requires an argument"),
        (["trian"], "No such command 'trian'. Did you mean 'train'?"),
        (["--bogus"], "No such option '--bogus'"),
        (["attack", "somewhere", "--round", "x"], "Invalid value for '--round': 'x' is not a valid integer"),
        (["attack", "somewhere"], "Missing option '--round'"),
        (["report", "--paper", "/nonexistent/p.toml", "somewhere"], "'/nonexistent/p.toml' does not exist"),
        (["report"], "Missing argument 'RUN_DIR...'"),
    ],
)
def test_what_click_refuses_while_parsing_is_one_line_too(args, expected):
    """A value of the wrong type, an unknown option or command, a missing
    value: one line naming it, status 2, not click's usage block."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedaval: error: "), result.stderr
    assert expected in lines[0]
    assert "Usage:" not in result.output
